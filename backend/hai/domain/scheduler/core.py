"""The time-sharing scheduling policy: one cycle, snapshot in, decisions out.

Order of work in a cycle (``schedule``):

1. Demote ABOVE_NORMAL jobs that have run ``demote_after_s`` to NORMAL (they count as NORMAL
   for the rest of the cycle: quotas and victim choice).
2. Index the free capacity of schedulable nodes; nodes reserved for a queued job (its
   ``reserved_nodes``) are kept out of the index.
3. Walk the queue by priority (high first), FIFO by first submission inside a priority. For
   each job: quota check; placement (fat-tree rules in ``placement``); if it cannot be placed,
   plan suspensions of lower-priority jobs (``preemption``). Jobs of the same shape that
   already failed in this cycle fail at once (capacity only shrinks during a cycle).
4. After each priority level, time-sharing: the level's jobs that waited past the threshold
   and are still unplaced, in order of their user's recent usage (least first), may take over
   from jobs of the same priority (other users) that have run a full quantum.
5. Every queued job that does not start gets a pending reason in words.

Reservations: ``Decisions.reservations`` is the complete set of reservations after this
cycle (the service replaces what it stored). A reserved node is used only by its owner, or by
a job of strictly higher priority than the owner (which would otherwise preempt for it); the
owner then re-plans in its own turn. A reservation ends when its owner starts (anywhere), is
quota-blocked, or has nothing left to wait for.
"""

from __future__ import annotations

import gc
import heapq
from operator import attrgetter

from hai.domain.jobs import JobState, Priority
from hai.domain.scheduler.explain import fmt_duration, plural, waiting_for_checkpoints
from hai.domain.scheduler.model import (
    Allocation,
    Decisions,
    Demote,
    Policy,
    QueuedJob,
    Snapshot,
    Start,
    Suspend,
    SuspendCode,
)
from hai.domain.scheduler.placement import FreeIndex, NodeSlot, Placement
from hai.domain.scheduler.preemption import Plan, RunningTable, plan_multi, plan_single
from hai.domain.scheduler.quota import QuotaBook

_BY_RANK = list(Priority)
_NORMAL_RANK = Priority.NORMAL.rank
_RANK_BY_ID = {id(p): p.rank for p in Priority}  # identity lookup: enum hashing is slow in a hot loop
_BY_ID = attrgetter("id")
_BY_SUBMIT = attrgetter("first_submitted_at")
_BY_PRIORITY = attrgetter("priority")
_RESERVED = attrgetter("reserved_nodes")


def _rank(p: Priority) -> int:
    r = _RANK_BY_ID.get(id(p))
    return r if r is not None else Priority(p).rank


def queue_order(job: QueuedJob) -> tuple:
    """Priority first (high to low), then FIFO by first submission (kept across suspensions)."""
    return (-job.priority.rank, job.first_submitted_at, job.id)


def schedule(snapshot: Snapshot, policy: Policy, now: float) -> Decisions:
    """One scheduling cycle. Pure: reads ``snapshot`` (never mutates it), returns decisions.

    The cyclic garbage collector is paused for the cycle: a cycle allocates tens of thousands
    of small objects (reasons, tuples, index entries) and creates no reference cycles that
    must be collected meanwhile, so the collector's passes over them are pure overhead (about
    5% of a cycle at Fire-Flyer scale). Reference counting still frees everything as usual.
    """
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _Cycle(snapshot, policy, now).run()
    finally:
        if paused:
            gc.enable()


class _Cycle:
    def __init__(self, snapshot: Snapshot, policy: Policy, now: float):
        self.snap = snapshot
        self.policy = policy
        self.now = now
        self.decisions = Decisions()
        self.index = FreeIndex(n for n in snapshot.nodes if n.schedulable)
        d = self.decisions

        # the queue by priority (high first), FIFO by first submission inside a priority
        # (two stable sorts with plain keys: faster than one sort on tuples)
        fifo = sorted(sorted(snapshot.queued, key=_BY_ID), key=_BY_SUBMIT)
        by_prio: dict[int, list[QueuedJob]] = {}  # id(priority) -> jobs
        pids = list(map(id, map(_BY_PRIORITY, fifo)))
        if fifo and pids.count(pids[0]) == len(pids):  # one priority: the common case
            by_prio[pids[0]] = fifo
        else:
            for k, j in zip(pids, fifo):
                lst = by_prio.get(k)
                if lst is None:
                    lst = by_prio[k] = []
                lst.append(j)
        by_level: dict[int, list[QueuedJob]] = {}
        for lst in by_prio.values():
            by_level.setdefault(_rank(lst[0].priority), []).extend(lst)
        if len(by_prio) != len(by_level):  # the same priority as distinct objects: re-sort the merged levels
            for lst in by_level.values():
                lst.sort(key=_BY_ID)
                lst.sort(key=_BY_SUBMIT)
        self.levels = [(r, by_level[r]) for r in sorted(by_level, reverse=True)]
        self.queue = fifo if len(self.levels) == 1 else [j for _, js in self.levels for j in js]
        self.pending_targets: dict[int, bool] = {}  # queued job id -> a job is suspending for it
        max_qrank = self.levels[0][0] if self.levels else -1

        # 1. running jobs: effective ranks and demotions now; which jobs could be victims (past
        #    their minimum runtime, past the quantum) only as far as this cycle needs to know
        running = snapshot.running
        n = len(running)
        rank_by_id = _RANK_BY_ID
        try:
            eff = [rank_by_id[id(r.priority)] for r in running]
        except KeyError:  # a priority that is not one of the enum's members (a plain string)
            eff = [_rank(r.priority) for r in running]
        self.eff_rank = eff
        self.min_ok = [False] * n
        self.quantum_ok = [False] * n
        self.members: list[int] = []  # the jobs the victim table indexes
        self.min_preemptible_rank: int | None = None  # lowest rank past its minimum runtime
        self.ts_users: dict[int, dict[str, int]] = {}  # rank -> user -> jobs past the quantum
        self._queued_ids: dict[int, bool] | None = None
        self._young: dict[int, int] | None = None
        suspending = JobState.SUSPENDING
        self.susp_mark = [False] * n
        for i in [i for i, r in enumerate(running) if r.suspend_requested_for is not None or r.state is suspending]:
            self.susp_mark[i] = True
            target = running[i].suspend_requested_for
            if target is not None and target in self.queued_ids:
                self.pending_targets[target] = True
                self.members.append(i)
        above_rank = Priority.ABOVE_NORMAL.rank
        if above_rank in eff:
            demote_after = policy.demote_after_s
            for i, r in enumerate(running):
                if eff[i] == above_rank and not self.susp_mark[i]:
                    ran = now - r.started_at
                    if ran >= demote_after:
                        d.demotions.append(
                            Demote(
                                r.id,
                                Priority.NORMAL,
                                f"ran {fmt_duration(ran)} at ABOVE_NORMAL; demoted to NORMAL after"
                                f" {fmt_duration(demote_after)}",
                            )
                        )
                        eff[i] = _NORMAL_RANK
        self.min_eff = min(eff) if eff else None
        self.present_ranks = dict.fromkeys(eff)  # (explanations) ranks with a running job
        self._max_qrank = max_qrank
        self._facts_ts = False
        self._facts_full = False
        if policy.preemption and n and self.min_eff < max_qrank:
            self._victim_facts(full=True)  # a lower-priority job may be preempted: look at all

        # quotas: everything holding GPUs counts, at its effective priority
        self.quota = QuotaBook(snapshot.quotas)
        self.quota.charge_all(snapshot.running, self.eff_rank)

        # at most one job spanning zones at a time (computed when a job asks for it)
        self._cross_running: bool | None = None

        # 2. reservations (first owner in queue order wins a node) and the index
        self.owner: dict[str, int] = {}
        self.owner_rank: dict[int, int] = {}
        self.owned: dict[int, list[str]] = {}
        for j in filter(_RESERVED, self.queue):
            mine: list[str] = []
            for name in j.reserved_nodes:
                if name in self.index.by_name and name not in self.owner:
                    self.owner[name] = j.id
                    mine.append(name)
            if mine:
                self.owned[j.id] = mine
                self.owner_rank[j.id] = j.priority.rank
        self.index.fill(self.owner)
        # lowest priority among reservation owners (may be stale-low: only used to skip work)
        self.lowest_owner_rank = min(self.owner_rank.values(), default=None)

        self._table: RunningTable | None = None
        self._bounds: dict[int, tuple[int, int]] = {}
        self._held_cache: list[int] | None = None
        self._maxfree = -1
        self.place_fail: dict[tuple, str] = {}
        self.plan_fail: dict[tuple, bool] = {}
        self.note_cache: dict[tuple, str] = {}
        self.epoch = 0  # bumps when capacity is given back to the index (caches are then cleared)
        self.plans_applied = 0

    # -- helpers -------------------------------------------------------------------------------
    @property
    def cross_running(self) -> bool:
        if self._cross_running is None:
            zone_of = {n.name: n.zone for n in self.snap.nodes}
            self._cross_running = False
            for r in self.snap.running:
                if len(r.allocations) > 1:
                    z0 = zone_of.get(r.allocations[0].node)
                    if any(zone_of.get(a.node) != z0 for a in r.allocations):
                        self._cross_running = True
                        break
        return self._cross_running

    @property
    def queued_ids(self) -> dict[int, bool]:
        if self._queued_ids is None:
            self._queued_ids = {j.id: True for j in self.snap.queued}
        return self._queued_ids

    def _victim_facts(self, full: bool) -> None:
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
        for i in cands:
            r = running[i]
            ran = now - r.started_at
            mr = r.min_runtime_s
            if ran < (min_rt if mr is None else mr):
                continue
            rank = eff[i]
            if min_pr is None or rank < min_pr:
                min_pr = rank
            if ran >= quantum:
                if already:
                    continue
                min_ok_l[i] = q_ok_l[i] = True
                users = ts_users.get(rank)
                if users is None:
                    users = ts_users[rank] = {}
                users[r.user] = users.get(r.user, 0) + 1
                if ts or rank < max_qrank:
                    members.append(i)
                continue
            min_ok_l[i] = True
            if full and rank < max_qrank:
                members.append(i)
        self.min_preemptible_rank = min_pr if full else self.min_preemptible_rank
        self._facts_ts = True
        if full:
            self._facts_full = True

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

    def _young_lower(self, rank: int) -> int:
        if self.min_eff is None or self.min_eff >= rank:
            return 0
        self._victim_facts(full=True)
        return sum(n for r, n in self.young.items() if r < rank)

    def _could_preempt(self, job: QueuedJob, time_sharing: bool) -> bool:
        """Cheap test: is there any running job that could be a victim of this job?"""
        rank = _rank(job.priority)
        mpr = self.min_preemptible_rank
        if mpr is not None and mpr < rank:
            return True
        if time_sharing:
            self._victim_facts(full=False)
            users = self.ts_users.get(rank)
            if users and len(users) > (job.user in users):  # a user other than the job's own
                return True
        return False

    def _may_fit(self, job: QueuedJob) -> bool:
        """Upper bound, whoever the job: could suspending every job that might be a victim in
        this cycle make room for it at all (a node whose free GPUs plus its possible victims'
        GPUs are enough; enough such whole nodes in one zone)? Most failing plans stop here."""
        got = self._bounds.get(self.epoch)
        if got is None:
            held = self._held()
            slots = self.index.slots
            cap1 = max((len(s.free) + held[s.ord] for s in slots), default=0)
            per_zone = [0] * len(self.index.zones)
            for s in slots:
                if held[s.ord] + len(s.free) == s.gpus:
                    per_zone[s.zone_ix] += 1
            got = self._bounds[self.epoch] = (cap1, max(per_zone, default=0))
        if job.nodes == 1:
            return job.gpus_per_node <= got[0]
        return job.nodes <= got[1]

    def _held(self) -> list[int]:
        """GPUs held on each node by the jobs that may be victims (the victim table's ``held``,
        without building the table)."""
        if self._table is not None:
            return self._table.held
        if self._held_cache is None:
            self._victim_facts(full=False)
            by_name = self.index.by_name
            held = [0] * len(self.index.slots)
            running = self.snap.running
            for i in self.members:
                for a in running[i].allocations:
                    slot = by_name.get(a.node)
                    if slot is not None:
                        held[slot.ord] += len(a.gpus)
            self._held_cache = held
        return self._held_cache

    @property
    def table(self) -> RunningTable:
        if self._table is None:
            self._victim_facts(full=False)  # at least the jobs past the quantum (no-op when all known)
            self._table = RunningTable(
                self.snap.running,
                self.eff_rank,
                self.min_ok,
                self.quantum_ok,
                self.members,
                self.policy,
                self.now,
                self.index,
            )
        return self._table

    def _release(self, name: str) -> None:
        """A reserved node stops being reserved: its free GPUs go back to everyone."""
        self.owner.pop(name, None)
        slot = self.index.by_name[name]
        if not slot.indexed:
            self.index.insert(slot)
            if slot.free:
                self.place_fail.clear()
                self.plan_fail.clear()
                self.epoch += 1

    def _drop_reservation(self, job: QueuedJob) -> None:
        names = self.owned.pop(job.id, None)
        if names:
            for name in names:
                if self.owner.get(name) == job.id:
                    self._release(name)

    def _extras(self, job: QueuedJob) -> list[NodeSlot]:
        """Reserved nodes this job may use: its own, and those of lower-priority owners."""
        if not self.owner:
            return []
        rank = _rank(job.priority)
        low = self.lowest_owner_rank
        if low is None or low >= rank:
            own = self.owned.get(job.id)
            if not own:
                return []
            by_name = self.index.by_name
            return [by_name[n] for n in own if self.owner.get(n) == job.id]
        out = []
        for name, owner in self.owner.items():
            if owner == job.id or self.owner_rank[owner] < rank:
                out.append(self.index.by_name[name])
        return out

    def _usable(self, job: QueuedJob):
        if not self.owner:
            return lambda slot: True
        owner, owner_rank, jid, rank = self.owner, self.owner_rank, job.id, _rank(job.priority)

        def usable(slot: NodeSlot) -> bool:
            o = owner.get(slot.name)
            return o is None or o == jid or owner_rank[o] < rank

        return usable

    def _pending_idx(self, job: QueuedJob) -> list[int]:
        if job.id not in self.pending_targets:
            return []
        return self.table.pending_for.get(job.id, [])

    # -- placement -------------------------------------------------------------------------------
    def _find(self, job: QueuedJob, cross_ok: bool) -> Placement | None:
        if job.nodes == 1:
            return self.index.find_single(job.gpus_per_node)
        p = self.index.find_multi(job.nodes, job.gpus_per_node)
        if p is None and cross_ok:
            p = self.index.find_multi(job.nodes, job.gpus_per_node, cross_zone=True)
        return p

    def _fail_reason(self, job: QueuedJob, cross_ok: bool) -> str:
        idx = self.index
        reserved = len(self.owner)
        tail = f" ({plural(reserved, 'node')} reserved for other jobs)" if reserved else ""
        if job.nodes == 1:
            g = job.gpus_per_node
            if g > idx.max_gpus:
                return f"needs {g} GPUs on one node but the largest node has {idx.max_gpus}; ask for whole nodes"
            most = max(idx.max_free_partial(), idx.largest_idle_gpus())
            return f"needs {g} GPU(s) on one node; the most free on any available node is {most}{tail}"
        k = job.nodes
        largest_zone = max(idx.zone_size, default=0)
        best, best_zone = 0, None
        for z, zone in enumerate(idx.zones):
            c = sum(c for c, _ in idx.leaf_counts(z, job.gpus_per_node))
            if c > best or best_zone is None:
                best, best_zone = c, zone
        if k > largest_zone and not job.allow_cross_zone:
            return (
                f"needs {k} whole nodes in one zone but the largest zone has {largest_zone} schedulable nodes;"
                " it can only run with allow_cross_zone"
            )
        msg = f"needs {k} whole nodes in one zone; largest free block is {plural(best, 'node')}"
        if best_zone is not None:
            msg += f" in zone {best_zone}"
        if job.allow_cross_zone and not cross_ok:
            msg += "; another cross-zone job is running (one at a time)"
        elif job.allow_cross_zone:
            total = sum(c for c, _ in idx.leaf_counts(None, job.gpus_per_node))
            msg += f"; {total} free across zones"
        return msg + tail

    def _try_place(self, job: QueuedJob, extras: list[NodeSlot]) -> tuple[Placement | None, str, list[Allocation]]:
        cross_ok = job.allow_cross_zone and job.nodes > 1 and not self.cross_running
        key = (job.nodes, job.gpus_per_node, cross_ok)
        if not extras:
            cached = self.place_fail.get(key)
            if cached is not None:
                return None, cached, []
        for s in extras:
            self.index.insert(s)
        placement = self._find(job, cross_ok)
        allocs: list[Allocation] = []
        reason = ""
        if placement is not None:
            for slot in placement.slots:
                allocs.append(Allocation(slot.name, self.index.take(slot, placement.gpus_per_node)))
        else:
            reason = self._fail_reason(job, cross_ok)
        for s in extras:
            self.index.remove(s)
        if placement is None and not extras:
            self.place_fail[key] = reason
        return placement, reason, allocs

    def _start(self, job: QueuedJob, placement: Placement, allocs: list[Allocation]) -> None:
        d = self.decisions
        used = [s.name for s in placement.slots]
        # nodes it used stop being reserved (whoever owned them); its other reserved nodes free up
        for name in used:
            prev = self.owner.get(name)
            if prev is not None and prev != job.id:
                self.owned[prev] = [n for n in self.owned.get(prev, []) if n != name]
            if prev is not None:
                self._release(name)
        self._drop_reservation(job)
        d.starts.append(Start(job.id, tuple(allocs), placement.reason))
        self.quota.charge(job.group, _rank(job.priority), job.user, job.gpu_count)
        if len({s.zone for s in placement.slots}) > 1:
            self._cross_running = True

    # -- preemption ------------------------------------------------------------------------------
    def _plan(self, job: QueuedJob, time_sharing: bool) -> tuple[Plan | None, bool]:
        """(plan, deferred). ``deferred``: a plan exists but the per-cycle cap is reached."""
        pending = self._pending_idx(job)
        own = job.id in self.owned
        cap_reached = self.plans_applied >= self.policy.max_preemptions_per_cycle
        key = (job.nodes, job.gpus_per_node, _rank(job.priority), time_sharing, job.user if time_sharing else "")
        if not pending:
            if not self.policy.preemption or not self._could_preempt(job, time_sharing):
                if not own:
                    self.plan_fail[key] = True
                return None, False
            if not own and key in self.plan_fail:
                return None, False
            if not own and not self._may_fit(job):
                self.plan_fail[key] = True
                return None, False
            if cap_reached:
                return None, True  # victims may exist; the next cycle plans them
        table = self.table
        usable = self._usable(job)
        rank = _rank(job.priority)
        eligible = table.eligible_fn(rank, job.user, time_sharing and self.policy.preemption)
        if not self.policy.preemption:
            eligible = lambda i: False
        if job.nodes == 1:
            singles = table.singles() if self.policy.preemption else None
            if self._maxfree < 0:  # free GPUs only shrink during a cycle: one bound serves all plans
                self._maxfree = max((len(s.free) for s in self.index.slots), default=0)
            plan = plan_single(
                table, self.index, job.gpus_per_node, usable, eligible, pending, singles, maxfree=self._maxfree
            )
        else:
            fast = same_user = None
            if self.policy.preemption and not pending:
                fast = table.zones(self.index)
                if time_sharing:
                    ranks, jobs_, user = table.rank, table.jobs, job.user
                    same_user = lambda i: ranks[i] == rank and jobs_[i].user == user
            plan = plan_multi(
                table,
                self.index,
                job.nodes,
                job.gpus_per_node,
                usable,
                eligible,
                pending,
                fast,
                same_user,
                rank=rank,
                time_sharing=time_sharing,
            )
        if plan is None:
            if not pending and not own:
                self.plan_fail[key] = True
            return None, False
        if plan.victims and cap_reached:
            return None, True
        return plan, False

    def _apply_plan(self, job: QueuedJob, plan: Plan) -> None:
        d = self.decisions
        table = self.table
        pol = self.policy
        for i in plan.victims:
            table.chosen[i] = True
            v = table.jobs[i]
            vrank = table.rank[i]
            ran = fmt_duration(table.runtime[i])
            lost = table.lost[i]
            if vrank < _rank(job.priority):
                code = SuspendCode.OUTRANKED
                mr = v.min_runtime_s if v.min_runtime_s is not None else pol.min_runtime_s
                why = (
                    f"suspend at its next checkpoint for job {job.id} ({job.priority.value} outranks"
                    f" {_BY_RANK[vrank].value}); it ran {ran} (minimum {fmt_duration(mr)}),"
                    f" ~{lost:.0f} GPU-seconds since its last checkpoint"
                )
            else:
                code = SuspendCode.TIME_SHARING
                why = (
                    f"time-sharing: it ran {ran}, past the {fmt_duration(pol.quantum_s)} quantum at"
                    f" {_BY_RANK[vrank].value}; job {job.id} of user {job.user} has waited"
                    f" {fmt_duration(self.now - job.queued_at)}; ~{lost:.0f} GPU-seconds since its last checkpoint"
                )
            d.suspends.append(Suspend(v.id, why, for_job_id=job.id, code=code))
        if plan.victims:
            self.plans_applied += 1
        names = tuple(s.name for s in plan.slots)
        old = self.owned.get(job.id, [])
        for s in plan.slots:
            prev = self.owner.get(s.name)
            if prev is not None and prev != job.id:
                self.owned[prev] = [n for n in self.owned.get(prev, []) if n != s.name]
            self.owner[s.name] = job.id
            self.index.remove(s)
        self.owner_rank[job.id] = _rank(job.priority)
        if self.lowest_owner_rank is None or _rank(job.priority) < self.lowest_owner_rank:
            self.lowest_owner_rank = _rank(job.priority)
        self.owned[job.id] = list(names)
        for name in old:
            if name not in names and self.owner.get(name) == job.id:
                self._release(name)
        d.reservations[job.id] = names
        d.pending_reasons[job.id] = waiting_for_checkpoints(plan.waiting_on, names)

    def _note(self, job: QueuedJob, ts_tried: bool, deferred: bool) -> str:
        rank = _rank(job.priority)
        variant = 0
        if ts_tried and not deferred and self.policy.preemption and rank in self.present_ranks:
            self._victim_facts(full=False)
            users = self.ts_users.get(rank, {})
            variant = 2 if len(users) > (job.user in users) else 1  # a user other than the job's own
        key = (rank, ts_tried, deferred, variant)
        got = self.note_cache.get(key)
        if got is not None:
            return got
        pol = self.policy
        parts: list[str] = []
        if deferred:
            parts.append(
                f"suspending other jobs may make room; this cycle already planned {pol.max_preemptions_per_cycle}"
                " preemptions, the next cycle continues"
            )
        elif pol.preemption and self.snap.running:
            young = self._young_lower(rank)
            if young:
                parts.append(
                    f"{plural(young, 'lower-priority job')} could make room but"
                    f" {'has' if young == 1 else 'have'} run less than the {fmt_duration(pol.min_runtime_s)} minimum"
                )
            if variant == 2:
                parts.append(
                    f"time-sharing: no job of another user at {job.priority.value} that has run its"
                    f" {fmt_duration(pol.quantum_s)} quantum can make room"
                )
            elif variant == 1:
                parts.append(
                    f"time-sharing: no job of another user at {job.priority.value} has run its"
                    f" {fmt_duration(pol.quantum_s)} quantum yet"
                )
        note = "".join("; " + p for p in parts)
        self.note_cache[key] = note
        return note

    # -- the cycle -------------------------------------------------------------------------------
    def _process(self, job: QueuedJob, waiters: _Waiters) -> None:
        d = self.decisions
        if job.nodes < 1 or job.gpus_per_node < 1:
            d.pending_reasons[job.id] = "asks for no GPUs; nothing to schedule"
            self._drop_reservation(job)
            return
        blocked = self.quota.blocked(job)
        if blocked:
            d.pending_reasons[job.id] = blocked
            self._drop_reservation(job)
            return
        extras = self._extras(job)
        placement, reason, allocs = self._try_place(job, extras)
        if placement is not None:
            self._start(job, placement, allocs)
            return
        plan, deferred = self._plan(job, time_sharing=False)
        if plan is not None:
            self._apply_plan(job, plan)
            return
        pol = self.policy
        if pol.time_sharing and pol.preemption and job.queued_at <= self.now - pol.wait_threshold_s and not deferred:
            waiters.specials.setdefault(job.user, []).append((job, reason, self.epoch))
            d.pending_reasons[job.id] = reason
            return
        d.pending_reasons[job.id] = reason + self._note(job, False, deferred)
        self._drop_reservation(job)

    def _ts_one(self, job: QueuedJob, reason: str, epoch: int) -> tuple[bool, bool]:
        """Time-sharing for one waiting job: (made progress, deferred by the per-cycle cap)."""
        pend = self.decisions.pending_reasons
        if self.quota.enabled:
            blocked = self.quota.blocked(job)  # jobs of its bucket may have started since its turn
            if blocked:
                pend[job.id] = blocked
                self._drop_reservation(job)
                return False, False
        if epoch != self.epoch:  # capacity came back since this job's turn: try to place it again
            placement, reason, allocs = self._try_place(job, self._extras(job))
            if placement is not None:
                pend.pop(job.id, None)
                self._start(job, placement, allocs)
                return True, False
        plan, deferred = self._plan(job, time_sharing=True)
        if plan is not None:
            self._apply_plan(job, plan)
            return True, False
        pend[job.id] = reason + self._note(job, True, deferred)
        self._drop_reservation(job)
        return False, deferred

    def _time_share(self, waiters: _Waiters) -> None:
        """Time-sharing for one priority level: users in order of recent usage (least first;
        ties by their oldest waiting job), each user's waiting jobs in FIFO order. Jobs of one
        user and shape with nothing reserved behave alike: once one finds no victims, the rest
        of them keep the failure reason they were given (no per-job work)."""
        groups, specials = waiters.groups, waiters.specials
        if not groups and not specials:
            return
        usage = self.snap.usage
        oldest: dict[str, tuple[float, int]] = {}
        for user, byshape in groups.items():
            for _reason, _epoch, lst in byshape.values():
                k = (lst[0].first_submitted_at, lst[0].id)
                if user not in oldest or k < oldest[user]:
                    oldest[user] = k
        for user, lst2 in specials.items():
            k = (lst2[0][0].first_submitted_at, lst2[0][0].id)
            if user not in oldest or k < oldest[user]:
                oldest[user] = k
        pend = self.decisions.pending_reasons
        cap = self.policy.max_preemptions_per_cycle
        for user in sorted(oldest, key=lambda u: (usage.get(u, 0.0), oldest[u])):
            if self.plans_applied >= cap and user not in specials:
                # the cycle's preemption budget is spent: a user's groups are either deferred
                # to the next cycle (victims exist) or keep their reason (none exist)
                byshape = groups[user]
                first = next(iter(byshape.values()))[2][0]
                if self._could_preempt(first, True):
                    for reason, _e, lst in byshape.values():
                        got = reason + self._note(lst[0], True, True)
                        pend.update(dict.fromkeys([j.id for j in lst], got))
                continue
            heap: list[tuple] = []
            for k, (job, _r, _e) in enumerate(specials.get(user, ())):
                heap.append((job.first_submitted_at, job.id, 0, k, 0))
            for shape, (_r, _e, lst) in groups.get(user, {}).items():
                heap.append((lst[0].first_submitted_at, lst[0].id, 1, shape, 0))
            heapq.heapify(heap)
            while heap:
                _t, _id, kind, key, pos = heapq.heappop(heap)
                if kind == 0:
                    job, reason, epoch = specials[user][key]
                    self._ts_one(job, reason, epoch)
                    continue
                reason, epoch, lst = groups[user][key]
                ok, deferred = self._ts_one(lst[pos], reason, epoch)
                if ok:
                    if pos + 1 < len(lst):
                        nxt = lst[pos + 1]
                        heapq.heappush(heap, (nxt.first_submitted_at, nxt.id, 1, key, pos + 1))
                elif deferred:  # the rest of the group is deferred too, not out of victims
                    for job in lst[pos + 1 :]:
                        pend[job.id] = reason + self._note(job, True, True)

    def run(self) -> Decisions:
        pol = self.policy
        ts_on = pol.time_sharing and pol.preemption
        ts_since = self.now - pol.wait_threshold_s  # queued at or before this: past the threshold
        owned, pt, place_fail, plan_fail = self.owned, self.pending_targets, self.place_fail, self.plan_fail
        pend = self.decisions.pending_reasons
        quota = self.quota if self.quota.enabled else None
        cap = pol.max_preemptions_per_cycle
        mpr = self.min_preemptible_rank
        for rank, jobs in self.levels:
            level_epoch = self.epoch
            waiters = _Waiters()
            flat: dict[tuple[str, int, int], tuple[str, int, list[QueuedJob], str]] = {}
            final: dict[tuple[str, bool], str] = {}  # (placement reason, deferred) -> full reason
            prio_possible = pol.preemption and mpr is not None and mpr < rank
            for job in jobs:
                # fast path: a job whose shape already failed this cycle, nothing reserved for it,
                # and no preemption left to try; the full path handles everything else
                jid = job.id
                if (owned and jid in owned) or (pt and jid in pt) or job.allow_cross_zone:
                    self._process(job, waiters)
                    continue
                n, g = job.nodes, job.gpus_per_node
                reason = place_fail.get((n, g, False))
                # (a job within every cap's least headroom is within its quotas: no call needed)
                if reason is None or (
                    quota is not None and n * g > quota.min_headroom and quota.blocked(job) is not None
                ):
                    self._process(job, waiters)
                    continue
                deferred = False
                if prio_possible and (n, g, rank, False, "") not in plan_fail:
                    if self.plans_applied < cap:
                        self._process(job, waiters)
                        continue
                    deferred = True
                if ts_on and not deferred and job.queued_at <= ts_since:
                    gkey = (job.user, n, g)
                    grp = flat.get(gkey)
                    if grp is None:
                        # the reason its jobs keep if time-sharing finds nothing for them
                        grp = flat[gkey] = (reason, self.epoch, [], reason + self._note(job, True, False))
                    grp[2].append(job)
                    pend[jid] = grp[3]
                    continue
                fkey = (reason, deferred)
                got = final.get(fkey)
                if got is None:
                    got = final[fkey] = reason + self._note(job, False, deferred)
                pend[jid] = got
            for (user, n, g), (reason, epoch, lst, _final) in flat.items():
                waiters.groups.setdefault(user, {})[(n, g)] = (reason, epoch, lst)
            self._time_share(waiters)
            if self.epoch != level_epoch:
                self._retry_level(jobs)
        return self.decisions

    def _retry_level(self, jobs: list[QueuedJob]) -> None:
        """Reserved nodes were given back (their owner started elsewhere or gave up) after some
        of this level's jobs had their turn: offer the freed capacity to them again, in order
        (the next cycle would, a second later)."""
        d = self.decisions
        started = {s.job_id for s in d.starts}
        for job in jobs:
            jid = job.id
            if jid in started or jid in d.reservations or job.nodes < 1 or job.gpus_per_node < 1:
                continue
            if self.quota.enabled and self.quota.blocked(job) is not None:
                continue
            placement, _reason, allocs = self._try_place(job, self._extras(job))
            if placement is not None:
                d.pending_reasons.pop(jid, None)
                self._start(job, placement, allocs)


class _Waiters:
    """The jobs of one priority level that waited past the threshold and may time-share:
    ``groups`` (user -> (nodes, GPUs per node) -> (reason, epoch, jobs in FIFO order)) for jobs
    with nothing reserved, ``specials`` (user -> [(job, reason, epoch)]) for the others."""

    __slots__ = ("groups", "specials")

    def __init__(self) -> None:
        self.groups: dict[str, dict[tuple[int, int], tuple[str, int, list[QueuedJob]]]] = {}
        self.specials: dict[str, list[tuple[QueuedJob, str, int]]] = {}
