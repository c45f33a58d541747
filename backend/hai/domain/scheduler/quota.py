"""Quotas in GPUs per (group, priority) and optionally per user inside a group.

Semantics (documented for admins and the live service):

* ``Quota(group, priority, gpus)`` caps the GPUs held by all of the group's active jobs
  (starting, running, suspending) whose *effective* priority is ``priority``.
* ``Quota(group, priority, gpus, user=u)`` caps user ``u``'s jobs in that group at that priority.
* No quota row for a (group, priority) means no cap there. Two rows for the same key: the
  smaller one holds.
* A job is started only if every cap that applies still holds after it starts, so quotas are
  never exceeded by the scheduler (if an admin lowers a quota below current use, nothing new
  starts in that bucket until use falls; running jobs are not killed for it).
"""

from __future__ import annotations

from collections.abc import Iterable

from hai.domain.jobs import Priority
from hai.domain.scheduler.model import QueuedJob, Quota

_MISSING = object()


class QuotaBook:
    def __init__(self, quotas: Iterable[Quota]):
        self.group_limit: dict[tuple[str, int], int] = {}
        self.user_limit: dict[tuple[str, int, str], int] = {}
        for q in quotas:
            if q.user is None:
                key = (q.group, q.priority.rank)
                self.group_limit[key] = min(q.gpus, self.group_limit.get(key, q.gpus))
            else:
                ukey = (q.group, q.priority.rank, q.user)
                self.user_limit[ukey] = min(q.gpus, self.user_limit.get(ukey, q.gpus))
        self.enabled = bool(self.group_limit or self.user_limit)
        # whether an answer depends on the user (some user has a cap); when not, the memo's
        # answers are shared by the group's users (``memo_key``)
        self.by_user = bool(self.user_limit)
        self.group_used: dict[tuple[str, int], int] = {}
        self.user_used: dict[tuple[str, int, str], int] = {}  # kept only when a user has a cap (read only then)
        self._memo: dict[tuple, str | None] = {}  # answers since the last charge
        # the least room left under any cap: a job needing no more GPUs than this is within
        # every quota, whatever its bucket (the common case, decided without a lookup)
        self.min_headroom: float = self._least_headroom()

    def _least_headroom(self) -> float:
        gu, uu = self.group_used, self.user_used
        return min(
            [
                *(limit - gu.get(key, 0) for key, limit in self.group_limit.items()),
                *(limit - uu.get(ukey, 0) for ukey, limit in self.user_limit.items()),
            ],
            default=float("inf"),
        )

    def charge(self, group: str, rank: int, user: str, gpus: int) -> None:
        if not self.enabled:
            return
        self._memo.clear()
        key = (group, rank)
        used = self.group_used[key] = self.group_used.get(key, 0) + gpus
        # only these two buckets lost room
        limit = self.group_limit.get(key)
        if limit is not None and limit - used < self.min_headroom:
            self.min_headroom = limit - used
        if not self.user_limit:
            return
        ukey = (group, rank, user)
        uused = self.user_used[ukey] = self.user_used.get(ukey, 0) + gpus
        ulimit = self.user_limit.get(ukey)
        if ulimit is not None and ulimit - uused < self.min_headroom:
            self.min_headroom = ulimit - uused

    def charge_all(self, running, ranks: list[int]) -> None:
        """Charge every running job (any sequence of RunningJob) at its effective rank."""
        if not self.enabled:
            return
        self._memo.clear()
        gu, uu = self.group_used, self.user_used
        users = bool(self.user_limit)
        for r, rank in zip(running, ranks, strict=True):
            allocs = r.allocations
            gpus = len(allocs[0].gpus) if len(allocs) == 1 else sum(len(a.gpus) for a in allocs)
            key = (r.group, rank)
            gu[key] = gu.get(key, 0) + gpus
            if users:
                ukey = (r.group, rank, r.user)
                uu[ukey] = uu.get(ukey, 0) + gpus
        self.min_headroom = self._least_headroom()

    @property
    def memo(self) -> dict[tuple, str | None]:
        """``blocked``'s answers since the last charge, by ``memo_key``: a caller in a hot loop
        may read an answer here before calling (emptied in place)."""
        return self._memo

    def memo_key(self, job: QueuedJob) -> tuple:
        """(group, user or None when no user has a cap, id(priority), GPUs): what an answer
        depends on."""
        return (job.group, job.user if self.by_user else None, id(job.priority), job.nodes * job.gpus_per_node)

    def blocked(self, job: QueuedJob) -> str | None:
        """None when the job may start within its quotas; else why not, in words."""
        if not self.enabled or job.nodes * job.gpus_per_node <= self.min_headroom:
            return None
        memo_key = self.memo_key(job)
        got = self._memo.get(memo_key, _MISSING)
        if got is _MISSING:
            got = self._memo[memo_key] = self._blocked(job)
        return got  # type: ignore[return-value]

    def _blocked(self, job: QueuedJob) -> str | None:
        rank = job.priority.rank
        need = job.gpu_count
        pname = job.priority.value
        key = (job.group, rank)
        limit = self.group_limit.get(key)
        if limit is not None:
            if need > limit:
                return f"needs {need} GPUs but group {job.group}'s quota at {pname} is {limit} GPUs"
            used = self.group_used.get(key, 0)
            if used + need > limit:
                return f"group {job.group} at {pname} uses {used} of {limit} GPUs; this job needs {need}"
        ukey = (job.group, rank, job.user)
        ulimit = self.user_limit.get(ukey)
        if ulimit is not None:
            if need > ulimit:
                return f"needs {need} GPUs but user {job.user}'s quota in group {job.group} at {pname} is {ulimit} GPUs"
            used = self.user_used.get(ukey, 0)
            if used + need > ulimit:
                return (
                    f"user {job.user} in group {job.group} at {pname} uses {used} of {ulimit} GPUs;"
                    f" this job needs {need}"
                )
        return None

    def violations(self) -> list[str]:
        """Buckets whose use exceeds their cap (for the simulator's independent check)."""
        out = []
        for (group, rank), limit in sorted(self.group_limit.items()):
            used = self.group_used.get((group, rank), 0)
            if used > limit:
                out.append(f"group {group} at {list(Priority)[rank].value}: {used} > {limit}")
        for (group, rank, user), limit in sorted(self.user_limit.items()):
            used = self.user_used.get((group, rank, user), 0)
            if used > limit:
                out.append(f"user {user} in {group} at {list(Priority)[rank].value}: {used} > {limit}")
        return out
