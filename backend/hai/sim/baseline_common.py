"""What the simulator's baseline policies (``las``, ``easy-fs``) share with the hai policy:
the placement rules (``domain.scheduler.placement.FreeIndex``: one zone, whole idle nodes on the
fewest leaves for multi-node jobs, best fit for one-node jobs), so only the policy differs.

A baseline is a stateful callable like ``hai.domain.scheduler.schedule``. It declares
``every_event = True``: the simulator runs a cycle after every event (no idle-cycle skipping,
whose proofs hold only for the hai policy and fifo) and at ``next_wakeup`` (a time at which one
of its rules can change its mind, e.g. a job crossing a Tiresias queue threshold). ``bind(sim)``
gives it the simulator's oracle facts: attained service, and (easy-fs only) exact durations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hai.domain.scheduler.model import Allocation, QueuedJob
from hai.domain.scheduler.placement import FreeIndex

if TYPE_CHECKING:
    from hai.sim.engine import Simulation


class Baseline:
    every_event = True

    def __init__(self) -> None:
        self.sim: Simulation | None = None
        self.next_wakeup: float | None = None

    def bind(self, sim: Simulation) -> None:
        self.sim = sim


def place(index: FreeIndex, job: QueuedJob) -> tuple[tuple[Allocation, ...], str] | None:
    """Place ``job`` on the index's free GPUs (taking them), or None."""
    if job.nodes == 1:
        p = index.find_single(job.gpus_per_node)
    else:
        p = index.find_multi(job.nodes, job.gpus_per_node)
    if p is None:
        return None
    allocs = tuple(Allocation(s.name, index.take(s, p.gpus_per_node)) for s in p.slots)
    return allocs, p.reason
