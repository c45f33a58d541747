"""The baseline: the public HAI release's scheduler (HFAiLab/hai-platform,
scheduler/modules/{assigners,matchers}/simple_fifo.py), restated on our snapshot.

What it keeps from that code:

* in-quota jobs only (out-of-quota jobs wait and do not block others);
* order by priority, then FIFO (first submission);
* a strict prefix: jobs start in that order while they fit; the first job that does not fit
  blocks every job behind it (the release computes ``cumsum(nodes) <= free nodes``);
* random nodes (``random.sample`` over the free ones), here from a seeded RNG so a run is
  reproducible.

Where it differs, to compare like with like: GPUs are handed out per GPU on one node for jobs
of up to one node (the release gives whole nodes to every job, which would waste 7/8 of the
cluster on Philly's 1-GPU jobs); multi-node jobs take random idle nodes anywhere, not aware
of zones or leaves (the release knows neither); and it never suspends running jobs (the
release suspends running jobs that fall outside the prefix, which only happens with several
priorities - the Philly trace has one).
"""

from __future__ import annotations

import random
from operator import attrgetter

from hai.domain.scheduler.model import Allocation, Decisions, Policy, Snapshot, Start
from hai.domain.scheduler.quota import QuotaBook

_BY_ID = attrgetter("id")
_BY_SUBMIT = attrgetter("first_submitted_at")
_PRIORITY = attrgetter("priority")


class FifoScheduler:
    """Callable like ``hai.domain.scheduler.schedule``; holds its own seeded RNG."""

    # jobs start strictly in queue order: a newly arrived job can only start if it is the new
    # head of the queue (the simulator skips cycles that cannot change anything)
    strict_order = True

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def __call__(self, snapshot: Snapshot, policy: Policy, now: float) -> Decisions:
        d = Decisions()
        quota = QuotaBook(snapshot.quotas)
        if quota.enabled:
            for r in snapshot.running:
                quota.charge(r.group, r.priority.rank, r.user, r.gpu_count)
        nodes = sorted((n for n in snapshot.nodes if n.schedulable), key=lambda n: n.name)
        free = {n.name: list(n.free_gpus) for n in nodes}
        size = {n.name: n.gpus for n in nodes}
        queue = sorted(sorted(snapshot.queued, key=_BY_ID), key=_BY_SUBMIT)
        if len(set(map(id, map(_PRIORITY, queue)))) > 1:
            queue.sort(key=lambda q: -q.priority.rank)  # stable: FIFO inside a priority
        for pos, job in enumerate(queue):
            blocked = quota.blocked(job)
            if blocked:
                d.pending_reasons[job.id] = blocked
                continue
            g = job.gpus_per_node
            if job.nodes == 1:
                cands = [n.name for n in nodes if len(free[n.name]) >= g]
            else:
                cands = [n.name for n in nodes if len(free[n.name]) == size[n.name] and size[n.name] >= g]
            if len(cands) < job.nodes:
                d.pending_reasons[job.id] = (
                    f"needs {job.nodes} node(s) x {g} GPU(s); only {len(cands)} node(s) can take it (FIFO head)"
                )
                # everyone behind the head waits (out-of-quota jobs do not block, as in the release)
                behind = f"waiting behind job {job.id} (FIFO: the queue head starts first)"
                rest = queue[pos + 1 :]
                if quota.enabled:
                    for other in rest:
                        d.pending_reasons[other.id] = quota.blocked(other) or behind
                else:
                    d.pending_reasons.update(dict.fromkeys(map(_BY_ID, rest), behind))
                break
            chosen = self.rng.sample(cands, job.nodes)
            allocs = []
            for name in chosen:
                gpus = tuple(free[name][:g])
                free[name] = free[name][g:]
                allocs.append(Allocation(name, gpus))
            d.starts.append(Start(job.id, tuple(allocs), "fifo: random free node(s)"))
            quota.charge(job.group, job.priority.rank, job.user, job.gpu_count)
        return d
