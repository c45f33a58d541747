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
from hai.domain.scheduler.model import QueuedJob, Quota, RunningDelta, RunningJob
from hai.domain.scheduler.victims import DEMOTED
from hai.domain.scheduler.victims import rank as _rank

_MISSING = object()
_DEMOTED_RANK, _NORMAL_RANK = DEMOTED.rank, Priority.NORMAL.rank


def _gpus(r: RunningJob) -> int:
    allocs = r.allocations
    return len(allocs[0].gpus) if len(allocs) == 1 else sum(len(a.gpus) for a in allocs)


def _sum_into(gu: dict, uu: dict | None, running, ranks: list[int]) -> None:
    """Each running job's GPUs (any sequence of RunningJob) added to its group's bucket at its
    rank in ``ranks`` (and to its user's, with ``uu``)."""
    for r, rank in zip(running, ranks, strict=True):
        allocs = r.allocations  # (``_gpus`` inline: a call per running job in a full sum)
        gpus = len(allocs[0].gpus) if len(allocs) == 1 else sum(len(a.gpus) for a in allocs)
        key = (r.group, rank)
        gu[key] = gu.get(key, 0) + gpus
        if uu is not None:
            ukey = (r.group, rank, r.user)
            uu[ukey] = uu.get(ukey, 0) + gpus


def _move(gu: dict, uu: dict | None, r: RunningJob, g: int, a: int, b: int) -> None:
    """The job's ``g`` GPUs moved from its group's (and user's) bucket at rank ``a`` to rank ``b``."""
    gu[(r.group, a)] -= g
    gu[(r.group, b)] = gu.get((r.group, b), 0) + g
    if uu is not None:
        uu[(r.group, a, r.user)] -= g
        uu[(r.group, b, r.user)] = uu.get((r.group, b, r.user), 0) + g


class KeptCharges:
    """The GPUs the running jobs of a snapshot hold at each (group, rank), and at each (group,
    rank, user) once asked for, at each job's own priority (before the cycle's demotions), kept
    by the caller from one cycle to the next (``KeptQueue.charges``; issue 12: summing every
    running job each cycle was ~4 ms of a 10k cycle).

    ``totals`` returns them for a snapshot's running tuple: as they are when it is the very
    tuple of the last call (tuples and jobs are frozen); updated by the jobs that left and came
    when the snapshot says how its tuple differs from that one (``model.RunningDelta``, the
    caller's account); else summed over every job again. The dicts returned are the kept ones:
    read, never changed, by the caller."""

    def __init__(self) -> None:
        self.running: tuple[RunningJob, ...] | None = None  # the tuple they count (held: its id is not reused)
        self.group: dict[tuple[str, int], int] = {}
        self.user: dict[tuple[str, int, str], int] | None = None  # None: not kept (no user had a cap)
        self.sums = 0  # (for tests and benchmarks) full sums
        self.accounts = 0  # (likewise) updates from the caller's account

    def totals(
        self, running: tuple[RunningJob, ...], delta: RunningDelta | None, users: bool, ranks: list[int],
        demoted: list[int],
    ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int, str], int] | None]:
        """``ranks``: the effective rank of each job of ``running`` in this cycle, ``demoted``
        the jobs (indices) this cycle demotes (their own rank is ABOVE_NORMAL): what a full sum
        reads."""
        if running is not self.running or (users and self.user is None):
            if (
                delta is not None
                and self.running is not None
                and delta.running is running
                and delta.base is self.running
                and (self.user is not None or not users)
            ):
                self._add(delta.left, -1)
                self._add(delta.came, 1)
                self.accounts += 1
            else:
                self._sum(running, users, ranks, demoted)
                self.sums += 1
            self.running = running
        return self.group, self.user

    def _sum(self, running: tuple[RunningJob, ...], users: bool, ranks: list[int], demoted: list[int]) -> None:
        """Every job summed (at its effective rank, as ``QuotaBook.charge_all``, then the
        demoted ones moved back to their own)."""
        gu: dict[tuple[str, int], int] = {}
        uu: dict[tuple[str, int, str], int] | None = {} if users else None
        _sum_into(gu, uu, running, ranks)
        self.group, self.user = gu, uu
        for i in demoted:  # kept at their own rank, not at the one they run at in this cycle
            r = running[i]
            _move(gu, uu, r, _gpus(r), _NORMAL_RANK, _DEMOTED_RANK)

    def _add(self, jobs: tuple[RunningJob, ...], sign: int) -> None:
        gu, uu = self.group, self.user
        for r in jobs:
            rank = _rank(r.priority)
            g = sign * _gpus(r)
            key = (r.group, rank)
            left = gu.get(key, 0) + g
            if left:
                gu[key] = left
            else:
                gu.pop(key, None)
            if uu is not None:
                ukey = (r.group, rank, r.user)
                left = uu.get(ukey, 0) + g
                if left:
                    uu[ukey] = left
                else:
                    uu.pop(ukey, None)


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
        _sum_into(self.group_used, self.user_used if self.user_limit else None, running, ranks)
        self.min_headroom = self._least_headroom()

    def charge_kept(self, kept: KeptCharges, running: tuple[RunningJob, ...], delta: RunningDelta | None,
                    ranks: list[int], demoted: list[int]) -> None:
        """As ``charge_all(running, ranks)``, in a cycle whose demotions are the jobs of
        ``demoted`` (indices into ``running``, each of them at ABOVE_NORMAL, now at NORMAL), from
        the totals ``kept`` keeps across cycles (``KeptCharges``) instead of a pass over every
        running job."""
        if not self.enabled:
            return
        self._memo.clear()
        users = bool(self.user_limit)
        group, user = kept.totals(running, delta, users, ranks, demoted)
        gu = self.group_used
        for key, g in group.items():
            gu[key] = gu.get(key, 0) + g
        if users:
            uu = self.user_used
            for ukey, g in user.items():  # type: ignore[union-attr]
                uu[ukey] = uu.get(ukey, 0) + g
        for i in demoted:  # charged at their own priority: moved to the one they run at now
            r = running[i]
            _move(gu, uu if users else None, r, _gpus(r), _DEMOTED_RANK, _NORMAL_RANK)
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
