"""Issue 12: scheduling cycles coalesce wake-ups. A burst of submissions does not cost one cycle
per submission, and every job is still considered by a cycle within 1 s of its submission.
Synchronised on the loop's cycle_done condition, never on sleeps."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from hai.services.runner import SchedulerLoop
from hai.services.scheduling import CycleResult

BURST = 40
WINDOW_S = 1.0


class RecordingLoop(SchedulerLoop):
    def __init__(self, platform) -> None:  # noqa: ANN001
        super().__init__(platform)
        self.results: list[tuple[float, CycleResult]] = []  # (monotonic start, result)

    def cycle_once(self, lease=None) -> CycleResult:  # noqa: ANN001
        t0 = time.monotonic()
        result = super().cycle_once(lease)
        self.results.append((t0, result))
        return result


def _considered(loop: RecordingLoop, ids: set[int]) -> bool:
    seen = set()
    for _, r in loop.results:
        seen.update(r.considered)
    return ids <= seen


def test_a_burst_of_submissions_costs_few_cycles_and_every_job_is_considered_within_a_second(api):
    for i, (zone, leaf) in enumerate([("A", "A1"), ("A", "A2"), ("B", "B1"), ("B", "B2")]):
        api.register_node(f"n{i}", zone=zone, leaf=leaf)
    assert 0 < api.platform.settings.scheduler.coalesce_s < WINDOW_S  # the default
    coalesce_s = api.platform.settings.scheduler.coalesce_s = 0.5  # still < WINDOW_S; fewer cycles on a slow machine
    loop = RecordingLoop(api.platform)
    thread = loop.start_thread()
    try:
        with loop.cycle_done:
            assert loop.cycle_done.wait_for(lambda: loop.cycles >= 1, timeout=60), "the scheduler never cycled"
        before = len(loop.results)

        t_first = time.monotonic()
        with ThreadPoolExecutor(8) as pool:  # 8 submitters at once, as a CI system bursts
            jobs = list(pool.map(lambda i: api.submit(name=f"burst-{i}", command=["sleep", "60"], gpus_per_node=1),
                                 range(BURST)))
        t_last = time.monotonic()
        ids = {j["id"] for j in jobs}

        with loop.cycle_done:
            assert loop.cycle_done.wait_for(lambda: _considered(loop, ids), timeout=60), "a job was never considered"

        # fewer cycles than submissions: at most one per coalesce_s while the burst lasted (+ the
        # one running when it began and the one that picks up its tail)
        during = [t for t, _ in loop.results[before:] if t_first <= t <= t_last]
        assert len(during) <= (t_last - t_first) / coalesce_s + 2, (len(during), t_last - t_first)
        assert len(loop.results) - before < BURST // 2, f"{len(loop.results) - before} cycles for {BURST} submissions"

        # ... and still every job considered by a cycle whose snapshot is within 1 s of its submission
        for job in jobs:
            created = datetime.fromisoformat(job["created_at"])
            first = min(r.at for _, r in loop.results if job["id"] in r.considered)
            assert (first - created).total_seconds() <= WINDOW_S, (job["id"], first, created)
    finally:
        loop.stop.set()
        api.platform.notifier.publish("scheduler")
        thread.join(timeout=30)
    assert not thread.is_alive()
