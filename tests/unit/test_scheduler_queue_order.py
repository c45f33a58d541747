"""The cycle's queue order (``core._levels`` and, with service classes, ``_Cycle._order_by_service``):
priority levels high first; within a level, service class (least attained service first), then
first submission, then id. The queue is split in the snapshot's own order and each part sorted
(a speed-up); this checks the result against the order written out as one sort key, on queues
with every priority, ties in submission time, a priority given as a plain string (a distinct
object of the same rank) and, under least attained service, every class and starved jobs."""

from __future__ import annotations

import random

import pytest

from hai.domain.jobs import Priority
from hai.domain.scheduler import Policy, QueuedJob, Snapshot
from hai.domain.scheduler.core import _Cycle, service_class

NOW = 1_000_000.0
CLASSES = (1000.0, 3250.0, 10_000.0, 32_500.0, 100_000.0)


def _queue(seed: int, n: int) -> tuple[QueuedJob, ...]:
    rng = random.Random(seed)
    prios: list = list(Priority) + ["NORMAL", "HIGH"]  # plain strings: same rank, other objects
    jobs = []
    for i in rng.sample(range(1, 10 * n), n):  # ids in no particular order
        sub = NOW - rng.choice([100.0, 200.0, 300.0]) - rng.randrange(50)  # many ties
        attained = 0.0 if rng.random() < 0.5 else 10 ** rng.uniform(1, 6)
        queued = sub + rng.uniform(0, 50)
        jobs.append(
            QueuedJob(i, f"u{i % 7}", "g", rng.choice(prios), rng.choice([1, 2]), rng.choice([1, 8]), sub, queued,
                      attained_gpu_s=attained)
        )  # fmt: skip
    return tuple(jobs)


def _rank(p) -> int:
    return Priority(p).rank


def _expected(queue, policy: Policy) -> list[tuple[int, list[int]]]:
    def cls(j: QueuedJob) -> int:
        if not policy.service_classes_gpu_s:
            return 0
        return service_class(policy, j.attained_gpu_s, j.gpu_count, NOW - j.queued_at)

    order = sorted(queue, key=lambda j: (-_rank(j.priority), cls(j), j.first_submitted_at, j.id))
    levels: dict[int, list[int]] = {}
    for j in order:
        levels.setdefault(_rank(j.priority), []).append(j.id)
    return list(levels.items())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "policy",
    [
        Policy(),
        Policy(service_classes_gpu_s=CLASSES),
        Policy(service_classes_gpu_s=CLASSES, starvation_factor=0.5),
    ],
    ids=["fifo", "classes", "classes-starvation"],
)
def test_the_queue_is_in_level_class_submission_id_order(seed, policy):
    queue = _queue(seed, 300)
    cycle = _Cycle(Snapshot(nodes=(), queued=queue), policy, NOW)
    got = [(rank, [j.id for j in jobs]) for rank, jobs in cycle.levels]
    assert got == _expected(queue, policy)
    if policy.service_classes_gpu_s:
        # the "waits behind N jobs" count: the jobs of its level in lower classes
        for rank, jobs in cycle.levels:
            classes = [service_class(policy, j.attained_gpu_s, j.gpu_count, NOW - j.queued_at) for j in jobs]
            assert list(cycle._class_stream(rank)) == classes
            for c in set(classes):
                assert cycle._ahead[rank][c] == sum(1 for k in classes if k < c)
