"""The control-plane crash loop (issue 13), shared by tests/faults (small) and
benchmarks/chaos.py (1,000 jobs, 100 kills): a replay of short jobs of several shapes and
priorities (some multi-node, some checkpointing, some meant to fail) while SIGKILL hits the
scheduler, the API servers and the Celery worker at random moments, each restarted at once;
then the cluster drains and the monitor's checks run."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from tests.faults.cluster import Cluster
from tests.faults.monitor import InvariantMonitor, Report

SHAPES = [  # (weight, submit keywords)
    (5, dict(seconds=0.5, gpus_per_node=1)),
    (3, dict(seconds=1.0, gpus_per_node=2, priority="LOW", checkpoint_every=0.3)),
    (2, dict(seconds=1.0, nodes=2, gpus_per_node=4)),  # multi-node jobs take whole nodes
    (2, dict(seconds=0.5, gpus_per_node=4, priority="HIGH")),
    (1, dict(seconds=0.3, gpus_per_node=1, exit_code=3)),  # fails by its own exit code
]


@dataclass
class CrashLoopResult:
    jobs: int
    kills: dict[str, int] = field(default_factory=dict)
    kills_total: int = 0
    submit_s: float = 0.0
    drain_s: float = 0.0
    report: Report | None = None

    def as_dict(self) -> dict:
        r = self.report
        assert r is not None
        return {
            "jobs_replayed": self.jobs, "kills_survived": self.kills_total, "kills_by_target": self.kills,
            "jobs_lost": len(r.lost), "jobs_not_terminal": len(r.not_terminal),
            "jobs_terminal_twice": len(r.terminal_twice), "gpus_given_twice": len(r.gpu_conflicts),
            "attempts_run_twice": len(r.attempt_conflicts), "false_failures": len(r.false_failures),
            "bad_resumes": len(r.bad_resumes), "rank0_overlaps": len(r.rank0_overlaps),
            "final_states": r.states, "monitor_samples": r.samples, "monitor_samples_db_away": r.sample_errors,
            "submit_s": round(self.submit_s, 1), "drain_s": round(self.drain_s, 1),
        }


def pick_shape(rng: random.Random) -> dict:
    total = sum(w for w, _ in SHAPES)
    x = rng.uniform(0, total)
    for w, kw in SHAPES:
        x -= w
        if x <= 0:
            return kw
    return SHAPES[-1][1]


def run_crash_loop(cluster: Cluster, *, jobs: int, kills: int, seed: int = 13,
                   drain_timeout_s: float = 1800, submit_rate_hz: float = 10.0) -> CrashLoopResult:
    rng = random.Random(seed)
    result = CrashLoopResult(jobs=jobs)
    targets = [*cluster.server_procs, cluster.scheduler, cluster.worker]
    stop = threading.Event()
    submitted = threading.Event()
    kill_lock = threading.Lock()

    def killer() -> None:
        # kills spread over the submission period and the start of the drain
        span_s = max(5.0, jobs / submit_rate_hz)
        for _ in range(kills):
            if stop.wait(rng.uniform(0.2, 2 * span_s / max(1, kills))):
                return
            with kill_lock:
                p = rng.choice(targets)
                p.kill9_group()
                result.kills[p.name] = result.kills.get(p.name, 0) + 1
                result.kills_total += 1
                p.start()  # restarted at once; submissions and agents retry meanwhile

    with InvariantMonitor(cluster.db_url) as monitor:
        t = threading.Thread(target=killer, name="chaos-killer", daemon=True)
        t.start()
        t0 = time.monotonic()
        ids = []
        for i in range(jobs):
            kw = pick_shape(rng)
            ids.append(cluster.submit(name=f"chaos-{i}", **kw))
            time.sleep(rng.expovariate(submit_rate_hz))
        result.submit_s = time.monotonic() - t0
        submitted.set()
        t.join()  # every kill happened (the last ones during the drain)
        for i in range(len(cluster.server_procs)):
            cluster.wait_server(i)
        t1 = time.monotonic()
        cluster.wait_terminal(ids, timeout=drain_timeout_s)
        result.drain_s = time.monotonic() - t1
        stop.set()
        result.report = monitor.final(accepted=cluster.accepted, expected_exit=cluster.expected_exit,
                                      marks=cluster.read_marks())
    return result
