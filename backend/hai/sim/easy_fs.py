"""Baseline ``--policy easy-fs``: Slurm-style priority with fair share and EASY backfill.

* Order: priority level first (high first), then fair share: each tenant's (the job's group,
  Slurm's account) decayed GPU usage, least first (Slurm's multifactor fair-share factor
  ``2^(-usage/shares)`` with equal shares orders tenants the same way), then first submission.
  Usage decays with ``half_life_s`` (Slurm's ``PriorityDecayHalfLife`` default, 7 days).
* Jobs start in that order while they fit. The first job that does not fit (the head) gets a
  reservation: the earliest time (its shadow time) at which, with the running jobs ending at
  their exact ends, enough GPUs come free for it, and the nodes that free them. Then EASY
  backfill over the next ``window`` jobs (Slurm ``bf_max_job_test``, 500): a job starts if it
  fits now and either ends before the shadow time or stays off the reserved nodes.
* Exact durations, as if every user set a perfect time limit (the simulator's oracle).
* Never preempts.

Placement as ours (``baseline_common.place``). Simplification: a reserved node is kept whole
for the head (Slurm would let a long job use the GPUs the head does not need on it).
"""

from __future__ import annotations

import math

from hai.domain.scheduler.model import Allocation, Decisions, Policy, QueuedJob, Snapshot, Start
from hai.domain.scheduler.placement import FreeIndex
from hai.sim.baseline_common import Baseline, place

WEEK_S = 7 * 86400.0


class EasyFsScheduler(Baseline):
    def __init__(self, half_life_s: float = WEEK_S, window: int = 500):
        super().__init__()
        self.lam = math.log(2) / half_life_s
        self.window = window
        self.usage: dict[str, float] = {}
        self.held: dict[str, int] = {}  # GPUs each tenant held after the last cycle
        self.last: float | None = None

    def _roll(self, now: float) -> None:
        if self.last is not None and now > self.last:
            decay = math.exp(-self.lam * (now - self.last))
            grow = (1 - decay) / self.lam
            for g in set(self.usage) | set(self.held):
                self.usage[g] = self.usage.get(g, 0.0) * decay + self.held.get(g, 0) * grow
        self.last = now

    def _duration(self, jid: int) -> float:
        return self.sim.jobs[jid].t.duration_s  # type: ignore[union-attr]

    def __call__(self, snapshot: Snapshot, policy: Policy, now: float) -> Decisions:
        assert self.sim is not None, "bind(sim) first"
        self._roll(now)
        d = Decisions()
        usage = self.usage
        order = sorted(
            snapshot.queued, key=lambda j: (-j.priority.rank, usage.get(j.group, 0.0), j.first_submitted_at, j.id)
        )
        index = FreeIndex(n for n in snapshot.nodes if n.schedulable)
        index.fill({})
        ends: list[tuple[float, tuple[Allocation, ...]]] = [
            (r.started_at + self._duration(r.id), r.allocations) for r in snapshot.running
        ]
        held: dict[str, int] = {}
        for r in snapshot.running:
            held[r.group] = held.get(r.group, 0) + r.gpu_count
        head: QueuedJob | None = None
        shadow = math.inf
        reserved: list = []
        failed: set[tuple[int, int, bool]] = set()
        tested = 0
        for job in order:
            jid = job.id
            if head is not None:
                tested += 1
                if tested > self.window:
                    d.pending_reasons[jid] = f"easy-fs: beyond the backfill window of {self.window} jobs"
                    continue
            short = head is not None and now + self._duration(jid) <= shadow
            key = (job.nodes, job.gpus_per_node, short)
            got = None
            if key not in failed:
                if short:
                    for s in reserved:
                        index.insert(s)
                got = place(index, job)
                if short:
                    for s in reserved:
                        index.remove(s)
                if got is None:
                    failed.add(key)
            if got is not None:
                allocs, why = got
                how = "in order" if head is None else ("backfilled before the head's reservation" if short else "backfilled off the reserved nodes")
                d.starts.append(Start(jid, allocs, f"easy-fs {how}: {why}"))
                ends.append((now + self._duration(jid), allocs))
                held[job.group] = held.get(job.group, 0) + job.gpu_count
                continue
            if head is None:
                head = job
                shadow, names = self._reserve(job, index, ends)
                reserved = [index.by_name[n] for n in names]
                for s in reserved:
                    index.remove(s)
                d.reservations[jid] = tuple(names)
                d.pending_reasons[jid] = f"easy-fs: head of the queue, nodes reserved from t={shadow:.0f}"
            else:
                d.pending_reasons[jid] = f"easy-fs: waits behind job {head.id} (does not fit the backfill holes)"
        self.held = held
        return d

    def _reserve(
        self, job: QueuedJob, index: FreeIndex, ends: list[tuple[float, tuple[Allocation, ...]]]
    ) -> tuple[float, list[str]]:
        """The head's shadow time and reserved nodes, releasing running jobs at their exact ends."""
        free = {s.name: len(s.free) for s in index.slots}
        size = {s.name: s.gpus for s in index.slots}
        zone = {s.name: s.zone for s in index.slots}
        g = job.gpus_per_node
        idle: dict[str, list[str]] = {}
        for s in index.slots:
            if free[s.name] == s.gpus and s.gpus >= g:
                idle.setdefault(s.zone, []).append(s.name)
        for z, names in idle.items():
            if job.nodes > 1 and len(names) >= job.nodes:
                return 0.0, names[: job.nodes]
        for end, allocs in sorted(ends, key=lambda e: e[0]):
            for a in allocs:
                if a.node not in free:
                    continue
                free[a.node] += len(a.gpus)
                if job.nodes == 1:
                    if free[a.node] >= g and size[a.node] >= g:
                        return end, [a.node]
                elif free[a.node] == size[a.node] and size[a.node] >= g:
                    lst = idle.setdefault(zone[a.node], [])
                    if a.node not in lst:
                        lst.append(a.node)
                    if len(lst) >= job.nodes:
                        return end, lst[: job.nodes]
        return math.inf, []
