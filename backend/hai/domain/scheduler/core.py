"""First scheduling policy: priority order, FIFO within a priority, gang placement.

(The full time-sharing policy replaces the body of ``schedule``; its signature stays.)
"""

from __future__ import annotations

from hai.domain.scheduler.model import Allocation, Decisions, NodeView, Policy, QueuedJob, Snapshot, Start


def queue_order(job: QueuedJob) -> tuple:
    return (-job.priority.rank, job.first_submitted_at, job.id)


def _place(job: QueuedJob, free: dict[str, list[int]], nodes: list[NodeView]) -> tuple[Allocation, ...] | None:
    if job.nodes == 1:
        # fewest free GPUs that still fit: pack partly used nodes first
        fits = [n for n in nodes if len(free[n.name]) >= job.gpus_per_node]
        if not fits:
            return None
        best = min(fits, key=lambda n: (len(free[n.name]), n.zone, n.leaf, n.name))
        return (Allocation(best.name, tuple(free[best.name][: job.gpus_per_node])),)
    whole = [n for n in nodes if len(free[n.name]) == n.gpus and n.gpus >= job.gpus_per_node]
    by_zone: dict[str, list[NodeView]] = {}
    for n in whole:
        by_zone.setdefault(n.zone, []).append(n)
    for zone in sorted(by_zone):
        candidates = sorted(by_zone[zone], key=lambda n: (n.leaf, n.name))
        if len(candidates) >= job.nodes:
            chosen = candidates[: job.nodes]
            return tuple(Allocation(n.name, tuple(free[n.name][: job.gpus_per_node])) for n in chosen)
    return None


def schedule(snapshot: Snapshot, policy: Policy, now: float) -> Decisions:
    decisions = Decisions()
    nodes = sorted((n for n in snapshot.nodes if n.schedulable), key=lambda n: (n.zone, n.leaf, n.name))
    free = {n.name: list(n.free_gpus) for n in nodes}
    for job in sorted(snapshot.queued, key=queue_order):
        placement = _place(job, free, nodes)
        if placement is None:
            decisions.pending_reasons[job.id] = (
                f"needs {job.nodes} node(s) x {job.gpus_per_node} GPU(s); not enough free GPUs"
            )
            continue
        for alloc in placement:
            free[alloc.node] = [g for g in free[alloc.node] if g not in alloc.gpus]
        decisions.starts.append(Start(job.id, placement, "first fit in priority order"))
    return decisions
