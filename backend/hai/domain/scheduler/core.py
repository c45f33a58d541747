"""The time-sharing scheduling policy: one cycle, snapshot in, decisions out.

The cycle reads as a script (``_Cycle.run``), in the manner of Kueue's ``schedule()``:

1. Queue heads: the queue by priority level (high first), FIFO by first submission inside a
   level (``_levels``).
2. Snapshot state, each part with one owner, built once: the free capacity of schedulable
   nodes (``placement.FreeIndex``); the running jobs as possible victims and this cycle's
   demotions of ABOVE_NORMAL jobs that ran ``demote_after_s`` (``victims.VictimFacts``: the
   demoted count as NORMAL for the rest of the cycle, quotas and victim choice included); the
   quotas (``quota.QuotaBook``); the reserved nodes, kept out of the index
   (``reservations.Reservations``, which also owns the memos that only hold while no capacity
   comes back, ``reservations.Memo``).
3. For each level, nominate each job down one ladder of exits (``_nominate_level``, where the
   outcome of every job is set): asks for no GPUs -> waits; quota-blocked -> waits; placed
   (fat-tree rules in ``placement``) -> starts; a plan of suspensions (``preemption``) ->
   reserves the nodes being freed; waited past the threshold -> time-sharing candidate; else
   waits, with the placement failure and what preemption could not do (``explain``). A rung is
   answered from the cycle's memos when they hold the answer (the shape already failed to
   place; no plan possible, or the per-cycle cap reached), which keeps a 10,000-job queue cheap.
4. After each level, time-sharing (``_time_share``): the level's jobs that waited past the
   threshold and are still unplaced, in order of their user's recent usage (least first), may
   take over from jobs of the same priority (other users) that have run a full quantum.
5. Capacity came back during the level (a reservation ended): offer it to the level's waiting
   jobs again (``_retry_level``).

Outcome of each queued job: a start, a reservation (with a pending reason naming the jobs it
waits for), or a pending reason in words. ``Decisions.reservations`` is the complete set of
reservations after this cycle (the service replaces what it stored).
"""

from __future__ import annotations

import gc
import heapq
from bisect import bisect_right
from collections import deque
from contextlib import contextmanager
from itertools import chain, compress, repeat
from operator import attrgetter, is_, itemgetter, le
from typing import Iterable, Iterator

from hai.domain.jobs import Priority
from hai.domain.scheduler.explain import (
    outranked_sentence,
    placement_failure,
    time_sharing_sentence,
    waiting_for_checkpoints,
    waiting_note,
)
from hai.domain.scheduler.explain import fmt_duration
from hai.domain.scheduler.kept import KeptQueue, Level
from hai.domain.scheduler.model import (
    Allocation,
    Decisions,
    Policy,
    QueuedJob,
    Snapshot,
    Start,
    Suspend,
    SuspendCode,
)
from hai.domain.scheduler.placement import FreeIndex, NodeSlot, Placement
from hai.domain.scheduler.preemption import Plan, plan_multi, plan_single
from hai.domain.scheduler.quota import QuotaBook
from hai.domain.scheduler.reservations import Memo, Reservations
from hai.domain.scheduler.victims import VictimFacts
from hai.domain.scheduler.victims import rank as _rank

_BY_RANK = list(Priority)
_BY_ID = attrgetter("id")
_BY_SUBMIT = attrgetter("first_submitted_at")
_BY_PRIORITY = attrgetter("priority")
_QUEUED_AT = attrgetter("queued_at")
_ATTAINED = attrgetter("attained_gpu_s")
_RESERVED = attrgetter("reserved_nodes")
# what a plain job's outcome reads of the job itself when every rung is answered from the memos
# (its level fixes its priority): the key of the level's fast lane
_LANE_KEY = attrgetter("nodes", "gpus_per_node", "group", "user", "allow_cross_zone")
# the same without the user (``_nominate_level``'s lane on a level of many lane keys)
_COARSE_KEY = attrgetter("nodes", "gpus_per_node", "group", "allow_cross_zone")
_FIRST = itemgetter(0)
_THIRD = itemgetter(2)
_APPEND = list.append
_MISSING = object()


def schedule(snapshot: Snapshot, policy: Policy, now: float, kept: KeptQueue | None = None) -> Decisions:
    """One scheduling cycle. Pure: reads ``snapshot`` (never mutates it), returns decisions.

    ``kept``: the queue in the cycle's order, kept by the caller from one cycle to the next
    (``kept.KeptQueue``; updated here from the jobs that arrived and left). The decisions are
    the same with it and without it; with it a cycle does not sort the whole queue again nor
    read every job's lane key from the job objects.

    The cyclic garbage collector is paused for the cycle: a cycle allocates tens of thousands
    of small objects (reasons, tuples, index entries) and creates no reference cycles that
    must be collected meanwhile, so the collector's passes over them are pure overhead (about
    5% of a cycle at Fire-Flyer scale). Reference counting still frees everything as usual.
    """
    with collector_paused():
        return _Cycle(snapshot, policy, now, kept).run()


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused for the block, and enabled again after it unless it
    was paused already (an outer block keeps it paused: ``services.scheduling.run_cycle`` pauses
    it for the whole cycle, the snapshot's read and the decisions' write included). It is
    process-wide: a block pauses it for every thread of the process while it runs."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


# What the trace simulator may rely on (``sim.skipping``): every queued job that fits starts in
# the cycle, so after a cycle nothing that fits is left waiting.
schedule.starts_every_fit = True  # type: ignore[attr-defined]


def _levels(
    queued: tuple[QueuedJob, ...], classes: list[int] | None = None
) -> tuple[list[tuple[int, list[QueuedJob]]], dict[int, list[tuple[int, int]]]]:
    """(rank, jobs) by priority level, high first, FIFO by first submission inside a level.
    (Two stable sorts with plain keys: faster than one sort on tuples.) The queue is split by
    priority in the snapshot's own order first and each part sorted after: every pass over
    100,000 jobs then reads them in the order they lie in memory (a pass in FIFO order reads
    them scattered), the same result as sorting the whole queue and splitting it.

    ``classes``: under least attained service, each job's service class (in the snapshot's
    order); each level is then ordered by class (least attained service first), FIFO within a
    class: the queue is split by (priority, class) in the same pass and each part sorted, the
    same order as bucketing each sorted level by class. Also returns, per rank, the level's
    classes in order with their job counts ([(class, jobs)]; empty without classes)."""
    parts: dict = {}  # id(priority), or (id(priority), class) -> jobs
    keys = list(map(id, map(_BY_PRIORITY, queued)))
    if classes is not None:  # one list per class under each priority (no tuple key per job)
        nc = max(classes, default=0) + 1
        by_pid: dict[int, list[list[QueuedJob]]] = {}
        if queued and keys.count(keys[0]) == len(keys):  # one priority: the common case
            b = by_pid[keys[0]] = [[] for _ in range(nc)]
            for c, j in zip(classes, queued):
                b[c].append(j)
        else:
            for k, c, j in zip(keys, classes, queued):
                b = by_pid.get(k)
                if b is None:
                    b = by_pid[k] = [[] for _ in range(nc)]
                b[c].append(j)
        parts = {(k, c): lst for k, b in by_pid.items() for c, lst in enumerate(b) if lst}
    elif queued and keys.count(keys[0]) == len(keys):  # one priority: the common case without classes
        parts[keys[0]] = list(queued)
    else:
        for k, j in zip(keys, queued):
            lst = parts.get(k)
            if lst is None:
                lst = parts[k] = []
            lst.append(j)
    for lst in parts.values():
        lst.sort(key=_BY_ID)
        lst.sort(key=_BY_SUBMIT)
    by_level: dict[int, dict[int, list[QueuedJob]]] = {}  # rank -> class -> jobs
    merged = 0
    if classes is None:
        for lst in parts.values():
            got = by_level.setdefault(_rank(lst[0].priority), {})
            merged += 0 in got
            got.setdefault(0, []).extend(lst)
    else:
        for (_pid, c), lst in parts.items():
            got = by_level.setdefault(_rank(lst[0].priority), {})
            merged += c in got
            got.setdefault(c, []).extend(lst)
    if merged:  # the same priority as distinct objects: re-sort the merged parts
        for got in by_level.values():
            for lst in got.values():
                lst.sort(key=_BY_ID)
                lst.sort(key=_BY_SUBMIT)
    levels: list[tuple[int, list[QueuedJob]]] = []
    runs: dict[int, list[tuple[int, int]]] = {}
    for r in sorted(by_level, reverse=True):
        got = by_level[r]
        if classes is None:
            levels.append((r, got[0]))
            continue
        order = sorted(got)
        levels.append((r, got[order[0]] if len(order) == 1 else list(chain.from_iterable(got[c] for c in order))))
        runs[r] = [(c, len(got[c])) for c in order]
    return levels, runs


def service_class(policy: Policy, attained_gpu_s: float, gpus: int, waited_s: float) -> int:
    """A waiting job's service class under least attained service (0 = least): how many of
    ``policy.service_classes_gpu_s`` its attained GPU-time has reached; back to 0 once it has
    waited (since it re-entered the queue) ``starvation_factor`` times its executed time.
    Within a priority level the queue is ordered by it, then by first submission."""
    c = bisect_right(policy.service_classes_gpu_s, attained_gpu_s)
    f = policy.starvation_factor
    if c and f > 0 and waited_s >= f * (attained_gpu_s / max(1, gpus)):
        c = 0  # starved: promoted to the first class
    return c


class _Cycle:
    """One cycle's state: its owners (index, facts, quota, reservations, memo) and the few
    counters the script itself keeps (plans applied against the per-cycle cap, cached bounds
    and sentences)."""

    # the fast lane of ``_nominate_level`` (a switch for the test that compares it with the
    # rungs walked for every job; it never changes a decision)
    fast_lane = True
    # below this many jobs in a level, lane keys rarely repeat (a Fire-Flyer level of 5,000 jobs
    # has ~3,000 (user, shape) keys): the lane's bookkeeping would cost more than it saves
    fast_lane_min_jobs = 8192
    # a kept level of fewer jobs takes the lane all the same when its jobs share few lane keys (a
    # sweep of like jobs: at most one key for every ``fast_lane_jobs_per_key`` jobs); a level of
    # many keys would pay the lane's bookkeeping for few hits (the Fire-Flyer kept cycle counted
    # 168 M -> 297 M instructions with the lane on every kept level of 256 jobs or more)
    fast_lane_kept_min_jobs = 256
    fast_lane_jobs_per_key = 8
    # a level of many lane keys, of at least this many jobs, takes the lane keyed without the
    # user (a switch for the tests that compare it with the ladder; it never changes a decision)
    coarse_lane = True
    coarse_lane_min_jobs = 256
    # ``_retry_level`` passes over a job whose shape failed with nothing reserved to add (a switch
    # for the test that compares it with trying every job; it never changes a decision)
    retry_skips_failed_shapes = True
    retry_skipped = 0  # (for that test) jobs passed over so
    # a time-sharing group formed after the cycle's plans were spent has its jobs' deferred
    # reason written by the level (a switch for the test that compares it with writing it in
    # ``_time_share``; it never changes a decision)
    defer_early = True

    def __init__(self, snapshot: Snapshot, policy: Policy, now: float, kept: KeptQueue | None = None):
        self.snap, self.policy, self.now = snapshot, policy, now
        self.decisions = Decisions()
        # 1. queue heads
        self.classes = policy.service_classes_gpu_s
        self._ahead: dict[int, dict[int, int]] = {}  # rank -> class -> jobs of the level in lower classes
        self._runs: dict[int, list[tuple[int, int]]] = {}  # rank -> [(class, jobs)] in queue order
        self._kept = kept.sync(snapshot, policy) if kept is not None and snapshot.queued else None
        if self._kept is not None:  # the order kept from the last cycle, updated
            self.levels = [(lv.rank, lv) for lv in self._kept]  # type: ignore[misc]
            if self.classes:
                self._runs = {lv.rank: lv.runs() for lv in self._kept}
                self._set_ahead()
            self._kept_q = kept
        elif self.classes and snapshot.queued:
            self.levels = self._order_by_service()
        else:
            self.levels = _levels(snapshot.queued)[0]
        # 2. the snapshot's state, each part with its owner
        self.index = FreeIndex((n for n in snapshot.nodes if n.schedulable), kept.slots if kept is not None else None)
        self.facts = VictimFacts(
            snapshot,
            policy,
            now,
            self.index,
            self.levels[0][0] if self.levels else -1,
            kept.ids() if self._kept is not None else None,  # type: ignore[union-attr]
            kept.places if kept is not None else None,
        )
        self.decisions.demotions = self.facts.demotions
        self.quota = QuotaBook(snapshot.quotas)  # everything holding GPUs counts, at its effective priority
        if kept is not None:  # from the totals kept across cycles (``quota.KeptCharges``)
            self.quota.charge_kept(kept.charges, snapshot.running, snapshot.running_delta, self.facts.eff_rank,
                                   self.facts.demoted)
        else:
            self.quota.charge_all(snapshot.running, self.facts.eff_rank)
        self.memo = Memo()
        self.res = Reservations(self._reserved_in_queue_order(), self.index, self.memo)  # first owner in queue order wins a node
        self._cross_running: bool | None = None  # a job spans zones (one at a time; computed when asked)
        self._bounds: dict[int, tuple[int, int]] = {}  # memo epoch -> (most GPUs on a node, whole nodes in a zone)
        self._maxfree = -1  # most free GPUs on any node (only shrinks during a cycle)
        self._notes: dict[tuple, str] = {}
        self._lane_gen = 0  # bumps whenever a fast lane is emptied (``_lane_misses``)
        self.plans_applied = 0
        self._las_nodes: dict[int, list[tuple]] | None = None  # node ord -> possible victims by class
        self._las_chosen: set[int] = set()
        self._las_fail: dict[tuple[int, int], int] = {}  # (rank, class) -> fewest GPUs that found no victims
        # jobs kept against least-attained-service suspension by a knob (grown quantum, long wait)
        self._keeps = bool(policy.service_quantum_factor or policy.service_protect_wait_factor) and bool(self.classes)
        self._las_kept: list[int] | None = None  # per service class: one-node jobs kept by those knobs

    def _reserved_in_queue_order(self) -> list[QueuedJob]:
        """The queued jobs with reserved nodes, in queue order: found in the snapshot's own
        order (one pass over the jobs as they lie in memory), then ordered by the queue's key
        (level high first, service class, first submission, id)."""
        got = self._kept_q.reserved() if self._kept is not None else list(filter(_RESERVED, self.snap.queued))
        cls = self._class_of if self.classes else lambda j: 0
        got.sort(key=lambda j: (-_rank(j.priority), cls(j), j.first_submitted_at, j.id))
        return got

    def run(self) -> Decisions:
        for rank, jobs in self.levels:
            level_epoch = self.memo.epoch
            waiters = self._nominate_level(rank, jobs)  # 3. start, reserve, or wait
            self._time_share(waiters)  # 4. time-sharing within the level
            if self.memo.epoch != level_epoch:
                self._retry_level(rank, jobs)  # 5. capacity came back: the level's jobs again
        return self.decisions

    # -- 3. nominate ---------------------------------------------------------------------------
    def _nominate_level(self, rank: int, jobs: list[QueuedJob]) -> _Waiters:
        """Each job of the level down one ladder of exits; the outcome of each is set here.

        A rung is answered from the cycle's memos for a *plain* job (nothing reserved for it,
        nothing suspending for it, not cross-zone) when they hold the answer: its shape already
        failed to place, no plan is possible for it or the per-cycle cap is reached. A job all of
        whose rungs were answered that way joins its (user, shape) group for time-sharing (the
        group shares one attempt); the others are time-shared one by one."""
        pol = self.policy
        ts_on = pol.time_sharing and pol.preemption
        ts_since = self.now - pol.wait_threshold_s  # queued at or before this: past the threshold
        owned, pt = self.res.owned, self.facts.pending_targets
        place_fail, plan_fail = self.memo.place_fail, self.memo.plan_fail
        pend = self.decisions.pending_reasons
        quota = self.quota if self.quota.enabled else None
        qmemo, q_by_user = self.quota.memo, self.quota.by_user  # (its key: ``QuotaBook.memo_key``)
        cap = pol.max_preemptions_per_cycle
        mpr = self.facts.min_preemptible_rank
        prio_possible = pol.preemption and mpr is not None and mpr < rank
        ahead = self._ahead.get(rank, {})
        waiters = _Waiters()
        # (user, nodes, GPUs a node) -> (reason, epoch, jobs, pending reason, their ids)
        groups: dict[tuple[str, int, int], tuple[str, int, list[QueuedJob], str, list[int], bool]] = {}
        final: dict[tuple[str, bool, int], str] = {}  # (placement failure, deferred, class) -> pending reason
        # The fast lane: a plain job all of whose rungs were answered from the memos, without
        # changing anything, leaves (its pending reason, the time-sharing group it joined) under
        # its lane key; the next plain job of that key gets the same outcome in O(1), as long as
        # nothing its rungs read has changed since (``_lane_state``: starts, quota charges,
        # plans, reservations, capacity given back, new memo entries; any change empties the
        # lane). With service classes the key holds the job's class too: the rungs read it (the
        # least-attained-service suspension, whose failures are memoised per class and GPU
        # count, and the "waits behind" sentence) and nothing else of it.
        # key -> (pending reason, the time-sharing group joined or None, that group's job ids or None)
        lane: dict[tuple, tuple[str, list[QueuedJob] | None, list[int] | None]] = {}
        lane_get = lane.get
        lane_on = self.fast_lane and (len(jobs) >= self.fast_lane_min_jobs
                                      or (isinstance(jobs, Level) and self._few_keys(jobs)))
        # A level of many lane keys (a key per user and shape) takes the lane keyed without the
        # user when no quota is per user: a plain job's outcome reads its user only when it
        # joins its user's time-sharing group, and that outcome is not kept under such a key
        # (the job walks the ladder). (The 10k cycle's VERY_HIGH level: 4,700 jobs, 1,500 lane
        # keys, 280 without the user.)
        coarse = (not lane_on and self.fast_lane and self.coarse_lane and len(jobs) >= self.coarse_lane_min_jobs
                  and not (quota is not None and q_by_user))
        lane_on = lane_on or coarse
        lane_state = self._lane_state()
        keys: Iterable = repeat(None)
        # each job's service class, from the level's runs of classes (0 without classes)
        classes: Iterable = self._class_stream(rank) if self.classes else repeat(0)
        todo: Iterable
        if lane_on and not coarse and isinstance(jobs, Level):  # the kept queue: keys kept, hits in bulk
            todo = self._lane_misses(jobs, ts_since, lane, pend, self._kept_q.positions(jobs, chain(owned, pt)))
        else:
            if lane_on:
                keys = zip(map(_COARSE_KEY if coarse else _LANE_KEY, jobs), map(le, map(_QUEUED_AT, jobs), repeat(ts_since)))
                if self.classes:
                    keys = zip(keys, self._class_stream(rank))
            todo = zip(jobs, keys, classes)
        for job, key, c in todo:
            jid = job.id
            hit = lane_get(key)
            if hit is not None and not ((owned and jid in owned) or (pt and jid in pt)):
                pend[jid] = hit[0]
                if hit[1] is not None:
                    hit[1].append(job)
                    hit[2].append(jid)
                continue
            # whether this job may have changed what ``_lane_state`` counts: it called one of the
            # methods that change it (placing, planning, a least-attained-service suspension) or
            # dropped a reservation it owned (a plain job owns none: its drop changes nothing);
            # a job that did none of that leaves the state as it was, unread (~7,000 reads a 10k
            # cycle)
            touched = False
            try:
                n, g = job.nodes, job.gpus_per_node
                plain = not ((owned and jid in owned) or (pt and jid in pt) or job.allow_cross_zone)
                # 1. asks for nothing
                if n < 1 or g < 1:
                    pend[jid] = "asks for no GPUs; nothing to schedule"
                    touched = not plain
                    self.res.drop(jid)
                    if plain and lane_on:
                        lane[key] = (pend[jid], None, None)
                    continue
                # 2. quota (a job within every cap's least headroom is within its quotas: no call)
                if quota is not None and n * g > quota.min_headroom:
                    # the book's memo read here (a method call per job cost ~1.5% of a 10k cycle)
                    blocked = qmemo.get((job.group, job.user if q_by_user else None, id(job.priority), n * g), _MISSING)
                    if blocked is _MISSING:
                        blocked = quota.blocked(job)
                    if blocked:
                        pend[jid] = blocked
                        touched = not plain
                        self.res.drop(jid)
                        if plain and lane_on:
                            lane[key] = (blocked, None, None)
                        continue
                # 3. placement -> started
                reason = place_fail.get((n, g, False)) if plain else None
                memo_only = reason is not None
                if reason is None:
                    touched = True
                    placement, reason, allocs = self._try_place(job, self.res.extras(job, rank))
                    if placement is not None:
                        self._start(job, placement, allocs)
                        continue
                # 4. preemption -> reserved
                deferred = False
                if memo_only and not (prio_possible and (n, g, rank, False, "") not in plan_fail):
                    pass  # no outranked job past its minimum runtime, or this shape found no plan
                elif memo_only and self.plans_applied >= cap:
                    deferred = True  # victims may exist; the next cycle plans them
                else:
                    memo_only = False
                    touched = True
                    plan, deferred = self._plan(job, time_sharing=False)
                    if plan is not None:
                        self._apply_plan(job, plan)
                        continue
                # 4b. least attained service: suspend jobs of its priority with more attained service
                if self.classes and n == 1 and not deferred and pol.preemption and self.plans_applied < cap:
                    touched = True
                    if self._las_preempt(job, rank, c):
                        continue
                # 5. waited past the threshold -> a time-sharing candidate (step 4 of the cycle)
                if ts_on and not deferred and job.queued_at <= ts_since:
                    if memo_only:
                        gkey = (job.user, n, g)
                        grp = groups.get(gkey)
                        if grp is None:
                            # the reason its jobs keep if time-sharing finds nothing for them;
                            # or, when the cycle's plans are spent already and the user's jobs
                            # could take a turn from others' (both stay so for the cycle), the
                            # reason ``_time_share`` gives them, deferred, unless the user has
                            # jobs of its own to time-share (it then writes them back first):
                            # each job's reason written once, not twice (~25,000 at 10k)
                            early = (self.defer_early and self.plans_applied >= cap
                                     and self.facts.could_preempt(job, True))
                            grp = groups[gkey] = (reason, self.memo.epoch, [],
                                                  reason + self._note(job, True, early), [], early)
                        grp[2].append(job)
                        grp[4].append(jid)
                        pend[jid] = grp[3]
                        if plain and lane_on and not coarse:  # (a group is its user's)
                            lane[key] = (grp[3], grp[2], grp[4])
                    else:
                        waiters.specials.setdefault(job.user, []).append((job, reason, self.memo.epoch))
                        pend[jid] = reason
                    continue
                # 6. waiting, with the placement failure and what preemption could not do
                fkey = (reason, deferred, c, n == 1)  # the kept note is for one-node jobs
                got = final.get(fkey)
                if got is None:
                    got = reason + self._note(job, False, deferred)
                    behind = ahead.get(c, 0)  # jobs of its level in lower service classes
                    if behind:
                        got += f"; waits behind {behind} job(s) with less attained service"
                    if self.classes:
                        got += self._class_note(c)
                        if n == 1 and self._keeps:
                            got += self._kept_note(c)
                    final[fkey] = got  # the whole sentence: every job of this key reads the same
                pend[jid] = got
                if not plain:
                    touched = True
                    self.res.drop(jid)
                elif memo_only and lane_on:
                    lane[key] = (got, None, None)
            finally:
                if lane_on and touched:  # whatever this job changed empties the lane before the next job
                    now_state = self._lane_state()
                    if now_state != lane_state:
                        lane.clear()
                        self._lane_gen += 1
                        lane_state = now_state
        for (user, n, g), (reason, epoch, lst, _final, ids, early) in groups.items():
            waiters.groups.setdefault(user, {})[(n, g)] = (reason, epoch, lst, ids, early)
        return waiters

    def _few_keys(self, lv: Level) -> bool:
        """A kept level of at least ``fast_lane_kept_min_jobs`` jobs whose first jobs (1,024, 64 at a
        time) hold at most one lane key (the kept key: lane key and class) for every
        ``fast_lane_jobs_per_key`` of them; a level of many keys is told after its first 64 jobs."""
        floor = self.fast_lane_kept_min_jobs
        if len(lv) < floor:
            return False
        per_key = self.fast_lane_jobs_per_key
        seen: set[int] = set()
        scanned = 0
        for b in lv.blocks:
            keys = b.keys
            for i in range(0, len(keys), 64):
                chunk = keys[i:i + 64]
                seen.update(chunk)
                scanned += len(chunk)
                if len(seen) * per_key > max(scanned, floor):
                    return False
                if scanned >= 1024:
                    return True
        return True

    def _lane_misses(
        self, lv: Level, ts_since: float, lane: dict, pend: dict[int, str], specials: dict[int, list[int]]
    ) -> Iterable[tuple[QueuedJob, int, int]]:
        """The fast lane over a kept level: the jobs whose lane key the lane does not hold (or
        that are not plain), as (job, key, class) for the ladder of ``_nominate_level``; the
        others take their outcome here, a chunk at a time, without reading the job objects
        (what the ladder would do for them one by one: a hit changes nothing, so a chunk of
        hits is a run of them). Resumed after the ladder handled each yielded job, so every
        chunk is looked up in the lane as that job left it. The key is the kept key (an even int
        per lane key and class) plus 1 past the wait threshold: the same facts as the
        from-scratch key.

        ``specials``: block -> positions of the jobs that owned reserved nodes or had jobs
        suspending for them when the level began (a superset of the jobs that are not plain
        when their turn comes: during a level only the job whose turn it is claims nodes);
        they go to the ladder one by one, which tells plain from not.

        Where the lane's misses will be is known ahead while the lane only grows: the first job
        of each key that the lane lacks (``_lane_predict``); the jobs between two such stops
        are looked up as one run (every lookup still checked: a job the lane turns out not to
        hold goes to the ladder like any miss). The stops are found again when the lane was
        emptied (``_lane_gen``) or a run met an unexpected miss. The prediction's own lookups
        serve the runs: while the lane only grows, a key it held then maps to the very same
        entry later (an entry is written only for a key the lane lacks), so only the jobs whose
        key it lacked then are looked up again (a run holding one is looked up whole)."""
        lane_get = lane.get
        for bi, b in enumerate(lv.blocks):
            jobs, ids, cls = b.jobs, b.ids, b.cls
            n = len(jobs)
            ek = b.lane_keys(ts_since)  # each job's lane key (read only)
            stops = specials.get(bi, [])
            i = 0
            plan: list[int] | None = None
            pi = gen = base = di = 0
            entries: list = []
            lacked: list[int] = []
            while i < n:
                if plan is None or gen != self._lane_gen:
                    plan, entries, lacked = self._lane_predict(ek, i, lane, stops, n)
                    pi, gen, base, di = 0, self._lane_gen, i, 0
                stop = plan[pi]
                if i < stop:  # a run of hits, as predicted
                    while di < len(lacked) and lacked[di] < i:
                        di += 1
                    if di < len(lacked) and lacked[di] < stop:  # a key the lane lacked then: look the run up now
                        hits = list(map(lane_get, ek[i:stop]))
                        # (nearly always all hits: ``index`` raising for it cost ~1 us a run)
                        k = hits.index(None) if None in hits else stop - i
                    else:  # the lane's entries when predicted, all hits (not searched for None)
                        hits = entries[i - base : stop - base]
                        k = stop - i
                    if k:
                        m = i + k
                        if k < len(hits):
                            del hits[k:]
                        pend.update(zip(ids[i:m], map(_FIRST, hits)))
                        # the time-sharing group joined (its ids; None: none): the group's job
                        # list is not appended here, ``_time_share`` reads the members by id
                        if any(map(_THIRD, hits)):  # (most runs join none)
                            gi = list(map(_THIRD, hits))
                            deque(map(_APPEND, filter(None, gi), compress(ids[i:m], gi)), 0)
                        i = m
                    if i < stop:  # a miss the prediction did not see: the ladder, then predict again
                        yield jobs[i], ek[i], cls[i]
                        i += 1
                        plan = None
                        continue
                if i < n:  # a predicted miss, or a job that may not be plain: the ladder decides
                    yield jobs[i], ek[i], cls[i]
                    i += 1
                    pi += 1

    @staticmethod
    def _lane_predict(ek: list[int], i: int, lane: dict, stops: list[int], n: int) -> tuple[list[int], list, list[int]]:
        """The positions from ``i`` on where the lane will miss while it only grows (the first
        job of each key it lacks now) and the ``stops`` from ``i`` on, sorted, then ``n``; the
        lane's entry (None: none) for each job from ``i`` on, as the lane holds them now; and,
        in order, the other positions whose key it lacks now (their entries are None)."""
        entries = list(map(lane.get, ek[i:n]))
        lacking = compress(range(i, n), map(is_, entries, repeat(None)))
        seen: set[int] = set()
        out: list[int] = []
        lacked: list[int] = []
        for p in lacking:
            k = ek[p]
            if k not in seen:
                seen.add(k)
                out.append(p)
            else:
                lacked.append(p)
        if stops:
            out = sorted(set(out).union(p for p in stops if p >= i))
        out.append(n)
        return out, entries, lacked

    def _lane_state(self) -> tuple[int, ...]:
        """What the fast lane's outcomes depend on beyond the job (see ``_nominate_level``)."""
        d, memo = self.decisions, self.memo
        return (
            memo.epoch,
            len(memo.place_fail),
            len(memo.plan_fail),
            self.plans_applied,
            len(d.starts),
            len(d.suspends),
            len(d.reservations),
            len(self.res.owner),
        )

    def _note(self, job: QueuedJob, ts_tried: bool, deferred: bool) -> str:
        """``explain.waiting_note``, one sentence per (rank, time-sharing tried, deferred, variant)."""
        rank = _rank(job.priority)
        variant = 0
        if ts_tried and not deferred and self.policy.preemption and rank in self.facts.present_ranks:
            variant = 2 if self.facts.other_users_past_quantum(rank, job.user) else 1
        key = (rank, ts_tried, deferred, variant)
        got = self._notes.get(key)
        if got is None:
            got = self._notes[key] = waiting_note(job, rank, self.facts, self.policy, variant, deferred)
        return got

    # -- placement -------------------------------------------------------------------------------
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

    def _find(self, job: QueuedJob, cross_ok: bool) -> Placement | None:
        if job.nodes == 1:
            return self.index.find_single(job.gpus_per_node)
        p = self.index.find_multi(job.nodes, job.gpus_per_node)
        if p is None and cross_ok:
            p = self.index.find_multi(job.nodes, job.gpus_per_node, cross_zone=True)
        return p

    def _try_place(self, job: QueuedJob, extras: list[NodeSlot]) -> tuple[Placement | None, str, list[Allocation]]:
        """Place the job on free GPUs and the reserved nodes it may use (``extras``); a shape
        that fails with no extras fails for every job of that shape until capacity comes back."""
        cross_ok = job.allow_cross_zone and job.nodes > 1 and not self.cross_running
        key = (job.nodes, job.gpus_per_node, cross_ok)
        place_fail = self.memo.place_fail
        if not extras:
            cached = place_fail.get(key)
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
            reason = placement_failure(job, self.index, len(self.res.owner), cross_ok)
        for s in extras:
            self.index.remove(s)
        if placement is None and not extras:
            place_fail[key] = reason
        return placement, reason, allocs

    def _start(self, job: QueuedJob, placement: Placement, allocs: list[Allocation]) -> None:
        self.res.started(job.id, [s.name for s in placement.slots])
        self.decisions.starts.append(Start(job.id, tuple(allocs), placement.reason))
        self.quota.charge(job.group, _rank(job.priority), job.user, job.gpu_count)
        if len({s.zone for s in placement.slots}) > 1:
            self._cross_running = True

    # -- preemption ------------------------------------------------------------------------------
    def _may_fit(self, job: QueuedJob) -> bool:
        """Upper bound, whoever the job: could suspending every job that might be a victim in
        this cycle make room for it at all (a node whose free GPUs plus its possible victims'
        GPUs are enough; enough such whole nodes in one zone)? Most failing plans stop here."""
        epoch = self.memo.epoch
        got = self._bounds.get(epoch)
        if got is None:
            held = self.facts.held()
            slots = self.index.slots
            cap1 = max((len(s.free) + held[s.ord] for s in slots), default=0)
            per_zone = [0] * len(self.index.zones)
            for s in slots:
                if held[s.ord] + len(s.free) == s.gpus:
                    per_zone[s.zone_ix] += 1
            got = self._bounds[epoch] = (cap1, max(per_zone, default=0))
        if job.nodes == 1:
            return job.gpus_per_node <= got[0]
        return job.nodes <= got[1]

    def _plan(self, job: QueuedJob, time_sharing: bool) -> tuple[Plan | None, bool]:
        """(plan, deferred). ``deferred``: a plan exists but the per-cycle cap is reached."""
        facts, pol, plan_fail = self.facts, self.policy, self.memo.plan_fail
        pending = facts.pending_for(job.id)
        own = job.id in self.res.owned
        cap_reached = self.plans_applied >= pol.max_preemptions_per_cycle
        key = (job.nodes, job.gpus_per_node, _rank(job.priority), time_sharing, job.user if time_sharing else "")
        if not pending:
            if not pol.preemption or not facts.could_preempt(job, time_sharing):
                if not own:
                    plan_fail[key] = True
                return None, False
            if not own and key in plan_fail:
                return None, False
            if not own and not self._may_fit(job):
                plan_fail[key] = True
                return None, False
            if cap_reached:
                return None, True  # victims may exist; the next cycle plans them
        table = facts.table
        rank = _rank(job.priority)
        usable = self.res.usable_fn(job, rank)
        eligible = table.eligible_fn(rank, job.user, time_sharing and pol.preemption)
        if not pol.preemption:
            eligible = lambda i: False
        if job.nodes == 1:
            singles = table.singles() if pol.preemption else None
            if self._maxfree < 0:  # free GPUs only shrink during a cycle: one bound serves all plans
                self._maxfree = max((len(s.free) for s in self.index.slots), default=0)
            plan = plan_single(
                table, self.index, job.gpus_per_node, usable, eligible, pending, singles, maxfree=self._maxfree
            )
        else:
            fast = same_user = None
            if pol.preemption and not pending:
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
                plan_fail[key] = True
            return None, False
        if plan.victims and cap_reached:
            return None, True
        return plan, False

    def _apply_plan(self, job: QueuedJob, plan: Plan) -> None:
        """Suspend the plan's victims (code and sentence each) and reserve its nodes."""
        d = self.decisions
        table = self.facts.table
        pol = self.policy
        job_rank = _rank(job.priority)
        for i in plan.victims:
            table.chosen[i] = True
            v = table.jobs[i]
            vrank = table.rank[i]
            if vrank < job_rank:
                mr = v.min_runtime_s if v.min_runtime_s is not None else pol.min_runtime_s
                why = outranked_sentence(job, _BY_RANK[vrank].value, table.runtime(i), mr, table.lost[i])
                d.suspends.append(Suspend(v.id, why, for_job_id=job.id, code=SuspendCode.OUTRANKED))
            else:
                why = time_sharing_sentence(
                    job, _BY_RANK[vrank].value, table.runtime(i), pol.quantum_s, self.now - job.queued_at, table.lost[i]
                )
                d.suspends.append(Suspend(v.id, why, for_job_id=job.id, code=SuspendCode.TIME_SHARING))
        if plan.victims:
            self.plans_applied += 1
        names = self.res.claim(job.id, job_rank, plan.slots)
        d.reservations[job.id] = names
        d.pending_reasons[job.id] = waiting_for_checkpoints(plan.waiting_on, names)

    # -- least attained service within a level ----------------------------------------------------
    def _order_by_service(self) -> list[tuple[int, list[QueuedJob]]]:
        """The levels, each by service class (least attained service first), FIFO within a
        class. The classes are computed in the snapshot's order (one pass over the jobs as they
        lie in memory) and the queue split by (priority, class) before sorting (``_levels``)."""
        queued, th, now, pol = self.snap.queued, self.classes, self.now, self.policy
        if pol.starvation_factor > 0:
            cs = [service_class(pol, j.attained_gpu_s, j.gpu_count, now - j.queued_at) for j in queued]
        else:  # most waiting jobs have attained nothing yet: one bisection serves them all
            zero = bisect_right(th, 0.0)
            cs = [bisect_right(th, a) if a else zero for a in map(_ATTAINED, queued)]
        levels, self._runs = _levels(queued, cs)
        self._set_ahead()
        return levels

    def _set_ahead(self) -> None:
        for rank_, runs in self._runs.items():
            ahead: dict[int, int] = {}
            pos = 0
            for c, k in runs:
                ahead[c] = pos
                pos += k
            self._ahead[rank_] = ahead

    def _class_of(self, job: QueuedJob) -> int:
        """A queued job's service class (as ``_order_by_service`` computed it)."""
        pol = self.policy
        if pol.starvation_factor > 0:
            return service_class(pol, job.attained_gpu_s, job.gpu_count, self.now - job.queued_at)
        return bisect_right(self.classes, job.attained_gpu_s)

    def _class_stream(self, rank: int) -> Iterable[int]:
        """The service class of each job of a level, in queue order (the level is ordered by
        class: runs of equal classes)."""
        return chain.from_iterable(repeat(c, k) for c, k in self._runs[rank])

    def _class_note(self, c: int) -> str:
        """Where least attained service put the job: its class, and the GPU-time after which it
        was demoted there."""
        if c == 0:
            return " (service class 0: least attained service)"
        return f" (service class {c}: demoted after {self.classes[c - 1] / 3600:.1f} GPU-hours of attained service)"

    def _kept_note(self, c: int) -> str:
        """One-node jobs in classes above ``c`` that a knob keeps on their GPUs (they would
        otherwise be suspended for a job of class ``c``)."""
        if self._las_kept is None:
            self._las_kept = self.facts.knob_kept  # (counted by the facts' full pass, when it ran)
            if self._las_kept is None:
                self._las_scan(victims=False)  # the counts only: no victim lists unless preemption asks
        k = sum(self._las_kept[c + 1 :])
        if not k:
            return ""
        pol = self.policy
        why = []
        if pol.service_quantum_factor:
            cl = f" in service class {pol.service_quantum_min_class} or above" if pol.service_quantum_min_class else ""
            why.append(f"a quantum of {pol.service_quantum_factor:g} x the time their attained service took{cl}")
        if pol.service_protect_wait_factor:
            why.append(f"they waited at least {pol.service_protect_wait_factor:g} x the time they ran")
        also = ", against time-sharing too" if pol.service_protect_time_sharing else ""
        return f"; {k} job(s) with more attained service keep their GPUs ({' or '.join(why)}{also})"

    def _las_victims(self) -> dict[int, list[tuple]]:
        """Per node: one-node running jobs past their minimum runtime in a service class above
        0 (and, with ``service_checkpoint_slack_s``, at most that long after their last
        checkpoint), highest class first, then least GPU-time lost. Built once per cycle, when
        asked."""
        if self._las_nodes is None:
            self._las_scan(victims=True)
        return self._las_nodes

    def _las_scan(self, *, victims: bool) -> None:
        """One pass over the running jobs: ``_las_kept`` (per service class, the one-node jobs
        that a knob keeps on their GPUs) and, with ``victims``, ``_las_nodes`` (``_las_victims``).
        Without: the counts alone, for the waiting jobs' notes (issue 12: a cycle that preempts
        nobody this way built every node's victim list only to count the kept jobs)."""
        nodes: dict[int, list[tuple]] = {}
        pol, now, th = self.policy, self.now, self.classes
        qf, qmc, pwf = pol.service_quantum_factor, pol.service_quantum_min_class, pol.service_protect_wait_factor
        eff, susp = self.facts.eff_rank, self.facts.susp_mark
        by_name = self.index.by_name
        th0, min_rt = th[0], pol.min_runtime_s
        slack = pol.service_checkpoint_slack_s
        kept = self._las_kept = [0] * (len(th) + 1)
        for i, r in enumerate(self.snap.running):
            allocs = r.allocations
            if susp[i] or len(allocs) != 1:
                continue
            ran = now - r.started_at
            mr = r.min_runtime_s
            if ran < (min_rt if mr is None else mr):
                continue  # its minimum runtime
            g = len(allocs[0].gpus)  # its GPU count (one allocation)
            a0 = r.attained_gpu_s
            attained = a0 + ran * g
            if qf and ran < qf * a0 / (g if g > 1 else 1) and (not qmc or bisect_right(th, attained) >= qmc):
                kept[bisect_right(th, attained)] += 1
                continue  # the quantum its attained service earned
            if attained < th0:
                continue  # service class 0: never a victim here
            if pwf and (now - r.first_submitted_at) * g >= (1.0 + pwf) * attained:
                kept[bisect_right(th, attained)] += 1
                continue  # it waited at least pwf times the time it ran: kept until it has run enough
            if not victims:
                continue
            slot = by_name.get(allocs[0].node)
            if slot is None:
                continue
            since = r.last_checkpoint_at if r.last_checkpoint_at is not None else r.started_at
            if slack and now - since > slack:
                continue  # too far from its last checkpoint: a victim again at its next one
            c = bisect_right(th, attained)
            nodes.setdefault(slot.ord, []).append((-c, g * max(0.0, now - since), i, eff[i], g, attained))
        for lst in nodes.values():
            lst.sort()
        if victims:
            self._las_nodes = nodes

    def _las_preempt(self, job: QueuedJob, rank: int, wcls: int) -> bool:
        """A one-node waiting job in service class ``wcls``: the node where suspending jobs of its
        priority in classes above ``wcls`` (with the free GPUs) makes room and loses the least
        GPU-time; suspend them and reserve the node. False: no such node."""
        g = job.gpus_per_node
        fkey = (rank, wcls)
        failed = self._las_fail.get(fkey)
        if failed is not None and g >= failed:
            return False
        table = self.facts._table
        chosen_t = table.chosen if table is not None else None
        chosen = self._las_chosen
        usable = self.res.usable_fn(job, rank)
        slots = self.index.slots
        best = None
        for o, lst in self._las_victims().items():
            slot = slots[o]
            if slot.gpus < g or not usable(slot):
                continue
            have = len(slot.free)
            vs: list[tuple] = []
            lost = 0.0
            for v in lst:
                negc, l, i, r_eff, k, _a = v
                if -negc <= wcls or r_eff != rank or i in chosen or (chosen_t is not None and chosen_t[i]):
                    continue
                vs.append(v)
                lost += l
                have += k
                if have >= g:
                    break
            if have >= g and vs:
                key = (lost, len(vs), o)
                if best is None or key < best[0]:
                    best = (key, slot, vs)
        if best is None:
            self._las_fail[fkey] = g if failed is None else min(failed, g)
            return False
        _key, slot, vs = best
        d = self.decisions
        running = self.snap.running
        for negc, l, i, _r, _k, attained in vs:
            chosen.add(i)
            if chosen_t is not None:
                chosen_t[i] = True
            why = (
                f"suspend at its next checkpoint for job {job.id}: it has attained"
                f" {attained / 3600:.1f} GPU-hours (service class {-negc}, demoted after"
                f" {self.classes[-negc - 1] / 3600:.1f} GPU-hours), job {job.id} {job.attained_gpu_s / 3600:.1f}"
                f" (class {wcls}); least attained service goes first within {job.priority.value}; it ran"
                f" {fmt_duration(self.now - running[i].started_at)}, about {l / 3600:.2f} GPU-hours since its last checkpoint are lost"
            )
            d.suspends.append(Suspend(running[i].id, why, for_job_id=job.id, code=SuspendCode.TIME_SHARING))
        self.plans_applied += 1
        names = self.res.claim(job.id, rank, [slot])
        d.reservations[job.id] = names
        d.pending_reasons[job.id] = (
            f"waiting for {len(vs)} job(s) with more attained service to reach a checkpoint; node {slot.name} reserved"
        )
        return True

    # -- 4. time-sharing -------------------------------------------------------------------------
    def _ts_one(self, job: QueuedJob, reason: str, epoch: int) -> tuple[bool, bool]:
        """Time-sharing for one waiting job: (made progress, deferred by the per-cycle cap)."""
        pend = self.decisions.pending_reasons
        if self.quota.enabled:
            blocked = self.quota.blocked(job)  # jobs of its bucket may have started since its turn
            if blocked:
                pend[job.id] = blocked
                self.res.drop(job.id)
                return False, False
        if epoch != self.memo.epoch:  # capacity came back since this job's turn: try to place it again
            placement, reason, allocs = self._try_place(job, self.res.extras(job, _rank(job.priority)))
            if placement is not None:
                pend.pop(job.id, None)
                self._start(job, placement, allocs)
                return True, False
        plan, deferred = self._plan(job, time_sharing=True)
        if plan is not None:
            self._apply_plan(job, plan)
            return True, False
        pend[job.id] = reason + self._note(job, True, deferred)
        self.res.drop(job.id)
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
            for _reason, _epoch, lst, _ids, _early in byshape.values():
                k = (lst[0].first_submitted_at, lst[0].id)
                if user not in oldest or k < oldest[user]:
                    oldest[user] = k
        for user, lst2 in specials.items():
            k = (lst2[0][0].first_submitted_at, lst2[0][0].id)
            if user not in oldest or k < oldest[user]:
                oldest[user] = k
        pend = self.decisions.pending_reasons
        cap = self.policy.max_preemptions_per_cycle
        byid = self._kept_q._byid if self._kept is not None else None
        deferred_as: dict[str, str] = {}  # a group's reason -> its pending reason when deferred

        def deferred_reason(reason: str, job: QueuedJob) -> str:
            # (the note is the level's own when deferred: one sentence per reason)
            got = deferred_as.get(reason)
            if got is None:
                got = deferred_as[reason] = reason + self._note(job, True, True)
            return got

        for user in sorted(oldest, key=lambda u: (usage.get(u, 0.0), oldest[u])):
            if self.plans_applied >= cap and user not in specials:
                # the cycle's preemption budget is spent: a user's groups are either deferred
                # to the next cycle (victims exist) or keep their reason (none exist)
                byshape = groups[user]
                first = next(iter(byshape.values()))[2][0]
                if self.facts.could_preempt(first, True):
                    for reason, _e, lst, ids, early in byshape.values():
                        if early:
                            continue  # (written so by the level already)
                        pend.update(zip(ids, repeat(deferred_reason(reason, lst[0]))))
                continue
            heap: list[tuple] = []
            for k, (job, _r, _e) in enumerate(specials.get(user, ())):
                heap.append((job.first_submitted_at, job.id, 0, k, 0))
            # shape -> the group's jobs in FIFO order; with the kept queue their ids (the kept
            # lane appended ids only), each job read by id when its turn comes: a group whose
            # first job finds no victims is not read further
            members: dict[tuple[int, int], list] = {}
            for shape, (reason, _e, lst, ids, early) in groups.get(user, {}).items():
                if early:  # the jobs' reason if time-sharing finds nothing, as the level would have written it
                    pend.update(zip(ids, repeat(reason + self._note(lst[0], True, False))))
                members[shape] = lst if byid is None else ids
                heap.append((lst[0].first_submitted_at, lst[0].id, 1, shape, 0))
            heapq.heapify(heap)
            while heap:
                _t, _id, kind, key, pos = heapq.heappop(heap)
                if kind == 0:
                    job, reason, epoch = specials[user][key]
                    self._ts_one(job, reason, epoch)
                    continue
                reason, epoch, _lst, _ids, _early = groups[user][key]
                lst = members[key]
                job = lst[pos] if byid is None else byid[lst[pos]]
                ok, deferred = self._ts_one(job, reason, epoch)
                if ok:
                    if pos + 1 < len(lst):
                        nxt = lst[pos + 1] if byid is None else byid[lst[pos + 1]]
                        heapq.heappush(heap, (nxt.first_submitted_at, nxt.id, 1, key, pos + 1))
                elif deferred:  # the rest of the group is deferred too, not out of victims
                    rest = map(_BY_ID, lst[pos + 1 :]) if byid is None else lst[pos + 1 :]  # (ids)
                    pend.update(zip(rest, repeat(deferred_reason(reason, job))))

    # -- 5. retry ---------------------------------------------------------------------------------
    def _retry_level(self, rank: int, jobs: list[QueuedJob]) -> None:
        """Reserved nodes were given back (their owner started elsewhere or gave up) after some
        of this level's jobs had their turn: offer the freed capacity to them again, in order
        (the next cycle would, a second later)."""
        d = self.decisions
        started = {s.job_id for s in d.starts}
        place_fail = self.memo.place_fail
        res = self.res
        for job in jobs:
            jid = job.id
            n, g = job.nodes, job.gpus_per_node
            if jid in started or jid in d.reservations or n < 1 or g < 1:
                continue
            # (``Reservations.extras``, asked only where it may be non-empty: the job owns nodes,
            # or some owner ranks below the level; a call per job was half of this pass)
            low = res.lowest_rank
            extras = (res.extras(job, rank) if res.owner and (jid in res.owned or (low is not None and low < rank))
                      else [])
            # a shape that failed with no reserved nodes to add fails again (``_try_place``'s
            # memo): nothing to do for the job, whatever its quota says
            if (self.retry_skips_failed_shapes and not extras
                    and (n, g, job.allow_cross_zone and n > 1 and not self.cross_running) in place_fail):
                self.retry_skipped += 1
                continue
            if self.quota.enabled and self.quota.blocked(job) is not None:
                continue
            placement, _reason, allocs = self._try_place(job, extras)
            if placement is not None:
                d.pending_reasons.pop(jid, None)
                self._start(job, placement, allocs)


class _Waiters:
    """The jobs of one priority level that waited past the threshold and may time-share:
    ``groups`` (user -> (nodes, GPUs per node) -> (reason, epoch, jobs in FIFO order, their ids,
    whether their reason was written deferred already; with the kept queue the job list holds
    only the members the ladder saw, the ids all)) for jobs
    with nothing reserved, ``specials`` (user -> [(job, reason, epoch)]) for the others."""

    __slots__ = ("groups", "specials")

    def __init__(self) -> None:
        self.groups: dict[str, dict[tuple[int, int], tuple[str, int, list[QueuedJob], list[int], bool]]] = {}
        self.specials: dict[str, list[tuple[QueuedJob, str, int]]] = {}
