"""What one cycle knows about the running jobs as possible victims, built once per cycle.

``VictimFacts`` owns every per-cycle fact about the snapshot's running jobs: effective ranks
(after this cycle's demotions), which jobs are already suspending (and for which queued job),
which are past their minimum runtime or past the quantum, the jobs the victim table indexes
(``members``), and the table itself (``victim_table.RunningTable``). The facts are computed only
as far as the cycle needs them: all of them when a lower-priority job may be preempted, only the
jobs past the quantum when time-sharing alone can preempt, none when nothing can.

Readers: the cycle (``core``), the planners (through ``table``) and the explanations
(``explain.waiting_note``). Nothing here changes during the cycle except the lazily filled facts
and the table's ``chosen`` marks (victims picked in this cycle).
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import compress, repeat
from operator import eq

from hai.domain.jobs import JobState, Priority
from hai.domain.scheduler.explain import demotion_sentence
from hai.domain.scheduler.model import Demote, Policy, QueuedJob, RunningJob, Snapshot
from hai.domain.scheduler.placement import FreeIndex
from hai.domain.scheduler.victim_table import KeptPlaces, RunningTable

RANK_BY_ID = {id(p): p.rank for p in Priority}  # identity lookup: enum hashing is slow in a hot loop
_NORMAL_RANK = Priority.NORMAL.rank
DEMOTED = Priority.ABOVE_NORMAL  # the priority whose jobs run at NORMAL after ``demote_after_s``


# Who may be suspended for whom (beside the minimum runtime, which every victim must have run,
# and "never a job already suspending or already chosen"); ``victim_table.RunningTable`` applies
# the same rules inline in its hot loop, the simulator's idle-cycle rules ask these.
def outranks(waiter_rank: int, victim_rank: int) -> bool:
    """Priority preemption: a waiting job may suspend a job of lower effective priority."""
    return victim_rank < waiter_rank


def may_take_turn(waiter_rank: int, waiter_user: str, victim_rank: int, victim_user: str) -> bool:
    """Time-sharing (the victim ran its quantum, the waiter waited past the threshold): only a
    job of the waiter's priority and of another user."""
    return victim_rank == waiter_rank and victim_user != waiter_user


def kept_by_service(policy: Policy, r: RunningJob, now: float) -> bool:
    """Least attained service (``Policy.service_quantum_min_class`` and
    ``service_protect_wait_factor``): is this running job kept on its GPUs now, by the quantum
    its attained service earned in its class or by having waited that many times what it ran?"""
    th = policy.service_classes_gpu_s
    if not th:
        return False
    g = max(1, r.gpu_count)
    ran = now - r.started_at
    attained = r.attained_gpu_s + ran * g
    qf, pwf = policy.service_quantum_factor, policy.service_protect_wait_factor
    if qf and ran < qf * r.attained_gpu_s / g and bisect_right(th, attained) >= policy.service_quantum_min_class:
        return True
    return bool(pwf) and attained >= th[0] and (now - r.first_submitted_at) * g >= (1.0 + pwf) * attained


def rank(p: Priority) -> int:
    r = RANK_BY_ID.get(id(p))
    return r if r is not None else Priority(p).rank


class VictimFacts:
    def __init__(
        self,
        snapshot: Snapshot,
        policy: Policy,
        now: float,
        index: FreeIndex,
        max_queued_rank: int,
        queued_ids: dict[int, object] | None = None,
        places: KeptPlaces | None = None,
    ):
        self.snap, self.policy, self.now, self.index = snapshot, policy, now, index
        running = snapshot.running
        n = len(running)
        try:
            eff = [RANK_BY_ID[id(r.priority)] for r in running]
        except KeyError:  # a priority that is not one of the enum's members (a plain string)
            eff = [rank(r.priority) for r in running]
        self.eff_rank = eff  # effective rank of each running job, after this cycle's demotions
        self.min_ok = [False] * n  # past its minimum runtime (known for the candidates looked at)
        self.quantum_ok = [False] * n  # past the quantum (likewise)
        self.members: list[int] = []  # the jobs the victim table indexes
        self.min_preemptible_rank: int | None = None  # lowest rank past its minimum runtime
        self.ts_users: dict[int, dict[str, int]] = {}  # rank -> user -> jobs past the quantum
        self.pending_targets: dict[int, bool] = {}  # queued job id -> a job is suspending for it
        self.demotions: list[Demote] = []
        self.demoted: list[int] = []  # the jobs of ``demotions`` (indices), in their order
        # the queued jobs' ids (membership only; the kept queue's id -> job map when there is one)
        self._queued_ids: dict[int, object] | None = queued_ids
        self._young: dict[int, int] | None = None
        self._max_qrank = max_queued_rank
        self._facts_ts = self._facts_full = False
        self._table: RunningTable | None = None
        self._places = places  # the running jobs' places kept by the caller (``victim_table.KeptPlaces``)
        # per service class: the one-node jobs past their minimum runtime that a least-attained-
        # service knob keeps on their GPUs (as ``core._Cycle._las_scan`` counts them), counted by
        # the full pass of ``ensure`` when the policy has such knobs; None: not counted
        self.knob_kept: list[int] | None = None

        suspending = JobState.SUSPENDING
        self.susp_mark = [False] * n  # suspending already (or asked to): never a victim again
        for i in [i for i, r in enumerate(running) if r.suspend_requested_for is not None or r.state is suspending]:
            self.susp_mark[i] = True
            target = running[i].suspend_requested_for
            if target is not None and target in self.queued_ids:
                self.pending_targets[target] = True
                self.members.append(i)
        above_rank = DEMOTED.rank
        if above_rank in eff:
            demote_after = policy.demote_after_s
            for i in list(compress(range(n), map(eq, eff, repeat(above_rank)))):  # (most jobs are not)
                r = running[i]
                if not self.susp_mark[i]:
                    ran = now - r.started_at
                    if ran >= demote_after:
                        self.demotions.append(Demote(r.id, Priority.NORMAL, demotion_sentence(ran, demote_after)))
                        self.demoted.append(i)
                        eff[i] = _NORMAL_RANK
        self.min_eff = min(eff) if eff else None
        self.present_ranks = dict.fromkeys(eff)  # (explanations) ranks with a running job
        if policy.preemption and n and self.min_eff < max_queued_rank:
            self.ensure(full=True)  # a lower-priority job may be preempted: look at all

    @property
    def queued_ids(self) -> dict[int, object]:
        if self._queued_ids is None:
            self._queued_ids = {j.id: True for j in self.snap.queued}
        return self._queued_ids

    def ensure(self, full: bool) -> None:
        """Which running jobs are past their minimum runtime (``full``: all of them) or past the
        quantum (otherwise: only those, enough for time-sharing within one priority)."""
        if self._facts_full or (self._facts_ts and not full):
            return
        running, eff, susp = self.snap.running, self.eff_rank, self.susp_mark
        pol, now = self.policy, self.now
        min_rt, quantum, ts = pol.min_runtime_s, pol.quantum_s, pol.time_sharing
        max_qrank = self._max_qrank
        if full:
            cands = [i for i in range(len(running)) if not susp[i]]
        else:
            cands = [i for i, r in enumerate(running) if now - r.started_at >= quantum and not susp[i]]
        min_ok_l, q_ok_l, members, ts_users = self.min_ok, self.quantum_ok, self.members, self.ts_users
        already = self._facts_ts  # time-sharing facts were filled in before: do not count twice
        min_pr = self.min_preemptible_rank
        kept = pol.service_protect_time_sharing and pol.service_classes_gpu_s
        # the knobs' kept jobs counted in the same pass (``knob_kept``; its own pass over the
        # running jobs, ``core._Cycle._las_scan``, cost ~5% of a 10k cycle)
        th = pol.service_classes_gpu_s
        qf, qmc, pwf = pol.service_quantum_factor, pol.service_quantum_min_class, pol.service_protect_wait_factor
        knobs = full and bool(th) and bool(qf or pwf)
        knob_kept = [0] * (len(th) + 1) if knobs else None
        th0 = th[0] if th else 0.0
        for i in cands:
            r = running[i]
            ran = now - r.started_at
            mr = r.min_runtime_s
            if ran < (min_rt if mr is None else mr):
                continue
            if knobs:  # as ``core._Cycle._las_scan`` (its expressions, for the same floats)
                allocs = r.allocations
                if len(allocs) == 1:
                    g = len(allocs[0].gpus)
                    a0 = r.attained_gpu_s
                    attained = a0 + ran * g
                    if qf and ran < qf * a0 / (g if g > 1 else 1) and (not qmc or bisect_right(th, attained) >= qmc):
                        knob_kept[bisect_right(th, attained)] += 1  # type: ignore[index]
                    elif attained >= th0 and pwf and (now - r.first_submitted_at) * g >= (1.0 + pwf) * attained:
                        knob_kept[bisect_right(th, attained)] += 1  # type: ignore[index]
            rank_ = eff[i]
            if min_pr is None or rank_ < min_pr:
                min_pr = rank_
            if ran >= quantum and not (kept and kept_by_service(pol, r, now)):
                if already:
                    continue
                min_ok_l[i] = q_ok_l[i] = True
                users = ts_users.get(rank_)
                if users is None:
                    users = ts_users[rank_] = {}
                users[r.user] = users.get(r.user, 0) + 1
                if ts or rank_ < max_qrank:
                    members.append(i)
                continue
            min_ok_l[i] = True
            if full and rank_ < max_qrank:
                members.append(i)
        self.min_preemptible_rank = min_pr if full else self.min_preemptible_rank
        self._facts_ts = True
        if full:
            self._facts_full = True
            self.knob_kept = knob_kept

    def could_preempt(self, job: QueuedJob, time_sharing: bool) -> bool:
        """Cheap test: is there any running job that could be a victim of this job?"""
        r = rank(job.priority)
        mpr = self.min_preemptible_rank
        if mpr is not None and mpr < r:
            return True
        if time_sharing:
            self.ensure(full=False)
            users = self.ts_users.get(r)
            if users and len(users) > (job.user in users):  # a user other than the job's own
                return True
        return False

    def other_users_past_quantum(self, r: int, user: str) -> bool:
        """(Explanations) does a job of another user at rank ``r`` run past the quantum?"""
        self.ensure(full=False)
        users = self.ts_users.get(r, {})
        return len(users) > (user in users)

    @property
    def young(self) -> dict[int, int]:
        """rank -> running jobs not yet past their minimum runtime (explanations only)."""
        if self._young is None:
            young: dict[int, int] = {}
            suspending = JobState.SUSPENDING
            eff, min_ok = self.eff_rank, self.min_ok
            for i, r in enumerate(self.snap.running):
                if not min_ok[i] and r.suspend_requested_for is None and r.state is not suspending:
                    young[eff[i]] = young.get(eff[i], 0) + 1
            self._young = young
        return self._young

    def young_lower(self, r: int) -> int:
        """Running jobs below rank ``r`` that have not run their minimum runtime yet."""
        if self.min_eff is None or self.min_eff >= r:
            return 0
        self.ensure(full=True)
        return sum(n for k, n in self.young.items() if k < r)

    @property
    def table(self) -> RunningTable:
        """The victim table (built on first use: most cycles at Fire-Flyer scale plan a few
        preemptions, many plan none)."""
        if self._table is None:
            self.ensure(full=False)  # at least the jobs past the quantum (no-op when all known)
            self._table = RunningTable(
                self.snap.running,
                self.eff_rank,
                self.min_ok,
                self.quantum_ok,
                self.members,
                self.policy,
                self.now,
                self.index,
                self._places,
            )
        return self._table

    def held(self) -> list[int]:
        """GPUs held on each node by the jobs that may be victims (the victim table's ``held``).
        Asked only by a plan's upper bound (``core._Cycle._may_fit``), which is followed by the
        plan itself, which builds the table, whenever it passes: a pass of its own over the
        allocations cost as much again (7 ms of a 10k cycle)."""
        return self.table.held

    def pending_for(self, job_id: int) -> list[int]:
        """The jobs already suspending for this queued job (indices into the table)."""
        if job_id not in self.pending_targets:
            return []
        return self.table.pending_for.get(job_id, [])
