"""Issue 12: scheduling cycles coalesce wake-ups. A burst of submissions does not cost one cycle
per submission, and no job waits past the first cycle that began after it was submitted.
Synchronised on the loop's cycle_done condition, never on sleeps. How soon that cycle comes (the
issue's "within 1 s") is wall-clock time, which a loaded machine stretches: benchmarks/api_load.py
measures it ("every job considered ... after its submission")."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from hai.services.runner import SchedulerLoop
from hai.services.scheduling import CycleResult

BURST = 40


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


def test_a_burst_of_submissions_costs_few_cycles_and_every_job_is_considered_by_the_next_cycle(api):
    for i, (zone, leaf) in enumerate([("A", "A1"), ("A", "A2"), ("B", "B1"), ("B", "B2")]):
        api.register_node(f"n{i}", zone=zone, leaf=leaf)
    assert 0 < api.platform.settings.scheduler.coalesce_s < 1.0  # the default
    coalesce_s = api.platform.settings.scheduler.coalesce_s = 0.5  # fewer cycles on a slow machine
    loop = RecordingLoop(api.platform)
    thread = loop.start_thread()
    try:
        with loop.cycle_done:
            assert loop.cycle_done.wait_for(lambda: loop.cycles >= 1, timeout=60), "the scheduler never cycled"
        before = len(loop.results)

        t_first = time.monotonic()
        with ThreadPoolExecutor(8) as pool:  # 8 submitters at once, as a CI system bursts
            def submit(i: int) -> tuple[dict, float]:  # the job and when its submission had committed
                job = api.submit(name=f"burst-{i}", command=["sleep", "60"], gpus_per_node=1)
                return job, time.monotonic()
            submitted = list(pool.map(submit, range(BURST)))
        jobs = [j for j, _ in submitted]
        t_last = time.monotonic()
        ids = {j["id"] for j in jobs}

        with loop.cycle_done:
            assert loop.cycle_done.wait_for(lambda: _considered(loop, ids), timeout=60), "a job was never considered"

        # fewer cycles than submissions: at most one per coalesce_s while the burst lasted (+ the
        # one running when it began and the one that picks up its tail)
        during = [t for t, _ in loop.results[before:] if t_first <= t <= t_last]
        assert len(during) <= (t_last - t_first) / coalesce_s + 2, (len(during), t_last - t_first)
        assert len(loop.results) - before < BURST // 2, f"{len(loop.results) - before} cycles for {BURST} submissions"

        # ... and still no job left for a later cycle: each was considered (queued, or started) at
        # the latest by the first cycle that began after its submission had committed
        for job, committed in submitted:
            first = min(t for t, r in loop.results if job["id"] in r.considered)
            nxt = [t for t, _ in loop.results[before:] if t >= committed]
            assert nxt, f"no cycle began after job {job['id']} was submitted"
            assert first <= nxt[0], (job["id"], first, nxt[0])
    finally:
        loop.stop.set()
        api.platform.notifier.publish("scheduler")
        thread.join(timeout=30)
    assert not thread.is_alive()
