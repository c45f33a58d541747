"""Victim choice: which running jobs to suspend (at their next checkpoint) for a waiting job.

Who may be a victim of waiting job J (checked by the caller's ``eligible``):

* a job of lower effective priority that has run at least its minimum runtime; or
* (time-sharing, once J has waited past the threshold) a job of J's priority, of another
  user, that has run a full quantum;
* never a job of J's user at J's priority, never a job already suspending, never a job
  already chosen as a victim in this cycle.

Among the victim sets that free a valid placement for J (one node with enough GPUs, or whole
nodes in one zone), choose the fewest victims, then the fewest GPU-seconds lost since their
last reported checkpoint, then the placement on fewer leaves, then node order. GPUs already
being released for J (jobs suspending for it) count as free for J. The planner only reads the
cycle's state (the victim table, ``victim_table``, and the free index); the caller applies a plan.

Strategies, one function each:

* one node (``plan_single``): ``_one_victim`` (a single victim suffices: the pair losing least,
  from the per-cycle list of (victim, node) pairs), else ``_fewest_victims_on_a_node`` (every
  candidate node, the fewest victims there, then least lost);
* whole nodes in one zone (``plan_multi``), per zone: the nodes to free taken cheapest first
  from the zone's per-cycle order (``_free_lazily``) or, when jobs are already suspending for J,
  from a scan of the zone (``_scanned_candidates``) heaped by ``_free_greedily`` (nodes needing
  the fewest victims first); then ``_place_on_freed`` (fewest leaves, then the nodes cheapest to
  free). A plan needing no victims beats any other: when nodes free now (counting what is
  being released for J) suffice, that plan is taken without weighing victims anywhere
  (``_free_now_plan``, over the idle nodes and those of J's suspending jobs only, and the
  first pass of ``_fewest_victims_on_a_node``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, combinations
from operator import attrgetter
from typing import NamedTuple

from hai.domain.scheduler.model import RunningJob
from hai.domain.scheduler.placement import FreeIndex, NodeSlot, choose_leaves
from hai.domain.scheduler.victim_table import FreeableNode, RunningTable, SortedPairs, VictimOnNode, ZoneClasses

_ORD = attrgetter("ord")


@dataclass(slots=True)
class Plan:
    victims: list[int]  # indices into RunningTable.jobs: new suspensions
    slots: list[NodeSlot]  # the nodes reserved for the waiting job
    waiting_on: int  # jobs (new victims + already suspending for it) that must checkpoint


# -- one node ------------------------------------------------------------------------------------


class _NodePick(NamedTuple):
    count: int  # victims
    lost: float  # their lost GPU-seconds
    gpus: int  # their GPUs on the node
    victims: list[int]


def _pick_on_node(
    cands: list[tuple[int, int]], need: int, lost: list[float], jobs: Sequence[RunningJob]
) -> _NodePick | None:
    """Fewest victims on one node freeing ``need`` GPUs, then least lost GPU-seconds.
    ``cands`` is [(gpus on this node, job index)]."""
    if sum(g for g, _ in cands) < need:
        return None
    by_size = sorted(cands, key=lambda t: (-t[0], lost[t[1]], jobs[t[1]].id))
    acc = 0
    count = 0
    for g, _ in by_size:
        acc += g
        count += 1
        if acc >= need:
            break
    if count == 1:
        best = min((t for t in cands if t[0] >= need), key=lambda t: (lost[t[1]], t[0], jobs[t[1]].id))
        return _NodePick(1, lost[best[1]], best[0], [best[1]])
    best_key = None
    best_set: list[int] = []
    if len(cands) <= 10:
        ordered = sorted(cands, key=lambda t: jobs[t[1]].id)
        for combo in combinations(ordered, count):
            if sum(g for g, _ in combo) < need:
                continue
            key = (sum(lost[i] for _, i in combo), sum(g for g, _ in combo), tuple(jobs[i].id for _, i in combo))
            if best_key is None or key < best_key:
                best_key = key
                best_set = [i for _, i in combo]
    else:
        best_set = [i for _, i in by_size[:count]]
        best_key = (sum(lost[i] for i in best_set), sum(g for g, _ in by_size[:count]), ())
    assert best_key is not None
    return _NodePick(count, best_key[0], best_key[1], best_set)


def plan_single(
    table: RunningTable,
    index: FreeIndex,
    gpus: int,
    usable: Callable[[NodeSlot], bool],
    eligible: Callable[[int], bool],
    pending: list[int],
    singles: dict[int, SortedPairs] | None = None,
    *,
    maxfree: int,
) -> Plan | None:
    """One node with ``gpus`` GPUs for the waiting job. ``maxfree``: an upper bound on the free
    GPUs of any node (a cycle's starts only ever lower it, so one bound serves a whole cycle).
    ``singles``: the table's (victim, node) pairs, when preemption is on."""
    scan: Sequence[NodeSlot] = index.slots
    if singles is not None and not pending:
        plan = _one_victim(index.slots, singles, gpus, usable, eligible, maxfree)
        if plan is not None:
            return plan
        scan = _nodes_where_victims_suffice(index.slots, singles, gpus, eligible)
        if not scan:
            return None
    # (every node scanned: the nodes free now are among those with a free GPU and the job's own)
    maybe_free = table.nodes_with_free(index) if scan is index.slots and gpus >= 1 else None
    return _fewest_victims_on_a_node(table, scan, gpus, usable, eligible, pending, maybe_free=maybe_free)


def _one_victim(
    slots: Sequence[NodeSlot],
    singles: dict[int, SortedPairs],
    gpus: int,
    usable: Callable[[NodeSlot], bool],
    eligible: Callable[[int], bool],
    maxfree: int,
) -> Plan | None:
    """The fewest victims is one whenever one victim suffices: take the pair losing least.
    ``singles`` is bucketed by the victim's GPUs on the node, each bucket least lost first: the
    first fit of each bucket, then the least lost of those (the same choice as one scan of all
    pairs in (lost, GPUs, node, job) order)."""
    best: VictimOnNode | None = None
    for g, bucket in singles.items():
        if g + maxfree < gpus:
            continue  # no node has enough free GPUs beside a victim of this size
        for entry in bucket.fitting(gpus, g, slots):  # (skips pairs whose node is too small for good)
            if best is not None and entry > best:
                break
            _lost, _gpus, o, _job_id, i = entry
            slot = slots[o]
            if slot.gpus < gpus or len(slot.free) + g < gpus or not eligible(i) or not usable(slot):
                continue
            best = entry
            break
    if best is None:
        return None
    _lost, _gpus, node, _job_id, job = best
    return Plan([job], [slots[node]], 1)


def _nodes_where_victims_suffice(
    slots: Sequence[NodeSlot], singles: dict[int, SortedPairs], gpus: int, eligible: Callable[[int], bool]
) -> list[NodeSlot]:
    """Several victims on one node: only nodes where all eligible victims together suffice."""
    acc: dict[int, int] = {}  # node ord -> GPUs of eligible victims there
    for bucket in singles.values():
        for _lost, g, o, _job_id, i in bucket.unordered():
            if slots[o].gpus >= gpus and eligible(i):
                acc[o] = acc.get(o, 0) + g
    return [slots[o] for o in sorted(acc) if len(slots[o].free) + acc[o] >= gpus]


def _fewest_victims_on_a_node(
    table: RunningTable,
    scan: Sequence[NodeSlot],
    gpus: int,
    usable: Callable[[NodeSlot], bool],
    eligible: Callable[[int], bool],
    pending: list[int],
    shortcuts: bool = True,
    maybe_free: list[int] | None = None,
) -> Plan | None:
    """Every node of ``scan``: free now (with the GPUs of jobs suspending for the waiting job)
    beats any victims; else the fewest victims there, then least lost, fewest GPUs, node order.
    (``shortcuts=False``: every node weighed, the reference the tests compare with.)

    ``maybe_free`` (``scan`` being every node, in node order): the nodes that may have a free
    GPU (``RunningTable.nodes_with_free``); the nodes free now are then looked for among them
    and the job's own only, not among every node (a job waiting for its checkpoints asks every
    cycle until they come): a node with no free GPU and none being released for the job has
    none for a job that asks for at least one."""
    pend_gpus: dict[int, int] = {}
    pend_jobs: dict[int, list[int]] = {}
    for i in pending:
        for o in table.nodes_of[i]:
            for hi, g in table.holders[o]:
                if hi == i:
                    pend_gpus[o] = pend_gpus.get(o, 0) + g
                    pend_jobs.setdefault(o, []).append(i)
    # a node free now (counting the GPUs being released for the job) beats any victims: the
    # lowest such node is the plan, found without weighing the victims of every node before it
    # (a job with jobs suspending for it has such a node: the one they free, 24 ms a plan at
    # 10,000 nodes when weighed); else every node is weighed below
    if shortcuts:
        # (with maybe_free: a node may come twice, once with a free GPU and once as the job's own)
        some = scan if maybe_free is None else [scan[o] for o in chain(maybe_free, pend_gpus)]
        free = [slot for slot in some
                if slot.gpus >= gpus and len(slot.free) + pend_gpus.get(slot.ord, 0) >= gpus and usable(slot)]
        if free:
            slot = min(free, key=_ORD)
            return Plan([], [slot], len(dict.fromkeys(pend_jobs.get(slot.ord, []))))
    best_key: tuple | None = None
    best: tuple[NodeSlot, list[int]] | None = None
    holders, lost, jobs = table.holders, table.lost, table.jobs
    for slot in scan:
        if slot.gpus < gpus:
            continue
        have = len(slot.free) + pend_gpus.get(slot.ord, 0)
        if have >= gpus:
            if not usable(slot):
                continue
            key: tuple = (0, 0.0, 0, slot.ord)
            if best_key is None or key < best_key:
                best_key, best = key, (slot, [])
            continue
        hs = holders[slot.ord]
        if not hs:
            continue
        need = gpus - have
        cands = [(g, i) for i, g in hs if eligible(i)]
        if not cands:
            continue
        if best_key is not None and best_key[0] == 0:
            continue
        if not usable(slot):
            continue
        picked = _pick_on_node(cands, need, lost, jobs)
        if picked is None:
            continue
        key = (picked.count, picked.lost, picked.gpus, slot.ord)
        if best_key is None or key < best_key:
            best_key, best = key, (slot, picked.victims)
    if best is None:
        return None
    slot, victims = best
    waiting = len(victims) + len(dict.fromkeys(pend_jobs.get(slot.ord, [])))
    return Plan(victims, [slot], waiting)


# -- whole nodes in one zone ---------------------------------------------------------------------


class _Candidates(NamedTuple):
    """The nodes of one zone that could be the waiting job's."""

    free_now: list[int]  # free without new victims
    need_of: dict[int, tuple[int, ...] | list[int]]  # node -> the victims that free it
    lost_of: dict[int, float]  # node -> their lost GPU-seconds (when known up front)
    waits_of: dict[int, list[int]]  # node -> jobs already suspending for the waiting job there
    potential: dict[int, int]  # leaf -> how many of its nodes could be freed (free now or need_of)


def plan_multi(
    table: RunningTable,
    index: FreeIndex,
    nodes: int,
    gpus_per_node: int,
    usable: Callable[[NodeSlot], bool],
    eligible: Callable[[int], bool],
    pending: list[int],
    fast: list[ZoneClasses] | None = None,
    same_user: Callable[[int], bool] | None = None,
    rank: int = 0,
    time_sharing: bool = False,
    shortcuts: bool = True,
) -> Plan | None:
    """``nodes`` whole nodes in one zone for the waiting job. ``fast``: the per-cycle zone
    classification of ``RunningTable.zones`` (only for a job with nothing suspending for it);
    ``same_user``: in time-sharing, tells a victim of the waiting job's own user at its rank.
    Of the zones' plans: fewest victims, least lost, fewest leaves, zone order. With jobs already
    suspending for the job, a zone with enough nodes free now wins without victims weighed
    anywhere (``_free_now_plan``; ``shortcuts=False``: every zone weighed, for the tests)."""
    pend = set(pending)  # membership only
    if pending:
        fast = None
        if shortcuts:
            got = _free_now_plan(index, table, nodes, gpus_per_node, usable, pend)
            if got is not None:
                return got
    lost = table.lost
    best_key: tuple | None = None
    best_plan: Plan | None = None
    zone_start = 0
    for z, _zone in enumerate(index.zones):
        size = index.zone_size[z]
        zone_slots = index.slots[zone_start : zone_start + size]
        zone_start += size
        if size < nodes:
            continue
        if fast is not None:
            got = _free_lazily(fast[z], z, index, table, nodes, gpus_per_node, usable, same_user, rank, time_sharing)
            if got is None:
                continue
            freed, cand = got
        else:
            cand = _scanned_candidates(zone_slots, table, gpus_per_node, usable, eligible, pend)
            if len(cand.free_now) + len(cand.need_of) < nodes:
                continue
            freed = _free_greedily(cand, index, table, nodes)
            if freed is None:
                continue
        placed = _place_on_freed(freed, cand, index, table, nodes)
        if placed is None:
            continue
        victims, picked, waiting, leaves = placed
        lost_s = sum(lost[i] for i in victims)
        key = (len(victims), lost_s, leaves, z)
        if best_key is None or key < best_key:
            best_key = key
            best_plan = Plan(victims, [index.slots[o] for o in sorted(picked)], len(victims) + len(waiting))
    return best_plan


def _free_now_plan(
    index: FreeIndex, table: RunningTable, nodes: int, gpus_per_node: int, usable: Callable[[NodeSlot], bool],
    pend: set[int],
) -> Plan | None:
    """``plan_multi``'s plan when some zone has enough nodes free now for the job (empty, or
    held only by jobs already suspending for it: ``_scanned_candidates`` with no job eligible
    as a victim), found without weighing any victim: such a zone's plan
    has no victims, and a zone short of free nodes needs at least one, so the best of these
    zones is the best of all (fewest leaves, then zone order). None: no zone has enough, or
    none of them places the job; the caller then weighs every zone.

    Only the nodes that can be free now are scanned, in node order: those idle when the cycle
    first asked (``RunningTable.idle_nodes``) and those holding a job suspending for this one.
    A node outside both either holds a job that is not suspending for this one, or has GPUs
    taken that no indexed job holds (and GPUs taken stay taken during a cycle): the scan of the
    whole zone passes it over too. So the candidates are that scan's, at a cost that follows
    the idle nodes and the job's own, not the cluster's size (a job waiting for checkpoints
    asks every cycle until they come)."""
    best_key: tuple | None = None
    best_plan: Plan | None = None
    idle = table.idle_nodes(index)
    nodes_of, slots = table.nodes_of, index.slots
    freeing = {o for i in pend for o in nodes_of[i]}  # the nodes of the jobs suspending for it
    zone_start = 0
    for z, size in enumerate(index.zone_size):
        lo = zone_start
        zone_start += size
        if size < nodes:
            continue
        ords = idle[z]
        here = [o for o in freeing if lo <= o < zone_start]
        if here:
            ords = sorted(set(ords).union(here))
        if len(ords) < nodes:
            continue  # (the nodes free now are among them)
        cand = _scanned_candidates([slots[o] for o in ords], table, gpus_per_node, usable, None, pend)  # no victims
        if len(cand.free_now) < nodes:
            continue
        placed = _place_on_freed(list(cand.free_now), cand, index, table, nodes)
        if placed is None:
            continue
        victims, picked, waiting, leaves = placed
        key = (leaves, z)
        if best_key is None or key < best_key:
            best_key = key
            best_plan = Plan(victims, [index.slots[o] for o in sorted(picked)], len(victims) + len(waiting))
    return best_plan


def _free_lazily(
    zone: ZoneClasses,
    z: int,
    index: FreeIndex,
    table: RunningTable,
    nodes: int,
    gpus_per_node: int,
    usable: Callable[[NodeSlot], bool],
    same_user: Callable[[int], bool] | None,
    rank: int,
    time_sharing: bool,
) -> tuple[list[int], _Candidates] | None:
    """Classifying every freeable node of the zone and ``_free_greedily`` together (the reference
    in tests/unit/test_scheduler_plan_tables.py), the same nodes freed in the
    same order, without looking at every freeable node of the zone: the zone's nodes come
    cheapest first from the per-cycle order (``ZoneClasses.order``: victims, lost; the greedy
    heap's key before the leaf's potential) and enter the heap only when their (victims, lost)
    is not above the heap's least, so the heap pops what the full heap would pop; a node's live
    facts (GPUs taken by this cycle's starts, victims already chosen, reservations, the user
    rule) are checked when it is reached or when a victim it shares is chosen, and a leaf's
    potential (its nodes that could be freed) is counted when first needed (it reads only
    facts that do not change during the plan). (freed nodes, the candidates they came from:
    the nodes free now and the looked-at nodes needing victims) or None: the zone cannot
    free enough."""
    slots = index.slots
    free_now: list[int] = []
    free_by_leaf: dict[int, int] = {}
    for o in zone.free_idle(slots):  # (of ``zone.idle``, those that may be free now)
        slot = slots[o]
        if slot.gpus >= gpus_per_node and len(slot.free) == slot.gpus and usable(slot):
            free_now.append(o)
            li = slot.leaf_ix
            free_by_leaf[li] = free_by_leaf.get(li, 0) + 1
    need_of: dict[int, tuple[int, ...] | list[int]] = {}
    cand = _Candidates(free_now, need_of, {}, {}, {})
    freed = list(free_now)
    if len(freed) >= nodes:
        return freed, cand
    held, chosen, lost, nodes_of = table.held, table.chosen, table.lost, table.nodes_of
    zone_ix = z
    looked: dict[int, bool] = {}  # node -> may be freed for this job (checked once)
    remaining: dict[int, int] = {}
    rem_lost: dict[int, float] = {}
    potential: dict[int, int] = {}  # leaf -> its nodes free now or that could be freed
    entry_of = zone.entry_of

    def check(e: FreeableNode) -> bool:
        o, blockers, lost_sum, top, top_young = e
        got = looked.get(o)
        if got is not None:
            return got
        ok = False
        if top < rank or (time_sharing and top == rank and top_young < rank):
            slot = slots[o]
            if slot.gpus >= gpus_per_node and held[o] + len(slot.free) == slot.gpus:
                for i in blockers:
                    if chosen[i] or (same_user is not None and same_user(i)):
                        break
                else:
                    ok = usable(slot)
        looked[o] = ok
        if ok:
            need_of[o] = blockers
            remaining[o] = len(blockers)
            rem_lost[o] = lost_sum
        return ok

    def pot(li: int) -> int:
        got = potential.get(li)
        if got is None:
            got = free_by_leaf.get(li, 0)
            for e in zone.by_leaf.get(li, ()):
                if check(e):
                    got += 1
            potential[li] = got
        return got

    at = zone.order(rank, time_sharing).at  # the k-th cheapest node (None past the last)
    nxt = at(0)
    pos = 0
    heap: list[tuple[int, float, int, int]] = []
    done: dict[int, bool] = {}
    chosen_mark: dict[int, bool] = {}
    while len(freed) < nodes:
        # every node not yet in the heap costs more (victims, lost) than the heap's least
        while nxt is not None and (not heap or nxt[:2] <= heap[0][:2]):
            k, lo, o = nxt
            pos += 1
            nxt = at(pos)
            if check(entry_of[o]):
                heapq.heappush(heap, (k, lo, -pot(slots[o].leaf_ix), o))
        if not heap:
            break
        cnt, lst, _pot, o = heapq.heappop(heap)
        if done.get(o) or cnt != remaining[o] or lst != rem_lost[o]:
            continue  # stale entry
        for i in need_of[o]:
            if chosen_mark.get(i):
                continue
            chosen_mark[i] = True
            for o2 in nodes_of[i]:
                if done.get(o2):
                    continue
                s2 = slots[o2]
                if s2.zone_ix != zone_ix:
                    continue
                e2 = entry_of.get(o2)
                if e2 is None or not check(e2):
                    continue
                remaining[o2] -= 1
                rem_lost[o2] -= lost[i]
                if remaining[o2] == 0:
                    done[o2] = True
                    freed.append(o2)
                else:
                    heapq.heappush(heap, (remaining[o2], rem_lost[o2], -pot(s2.leaf_ix), o2))
        if not done.get(o):  # all its blockers are chosen now
            done[o] = True
            freed.append(o)
    return (freed, cand) if len(freed) >= nodes else None


def _scanned_candidates(
    zone_slots: Sequence[NodeSlot],
    table: RunningTable,
    gpus_per_node: int,
    usable: Callable[[NodeSlot], bool],
    eligible: Callable[[int], bool] | None,
    pend: set[int],
) -> _Candidates:
    """Every node of the zone, with the jobs already suspending for the waiting job counted as
    freeing their GPUs. ``eligible`` None: no job may be a victim (only the nodes free now)."""
    free_now: list[int] = []
    need_of: dict[int, tuple[int, ...] | list[int]] = {}
    waits_of: dict[int, list[int]] = {}
    potential: dict[int, int] = {}  # leaf -> nodes in free_now or need_of
    holders = table.holders
    for slot in zone_slots:
        if slot.gpus < gpus_per_node:
            continue
        hs = holders[slot.ord]
        if not hs:
            if len(slot.free) == slot.gpus and usable(slot):
                free_now.append(slot.ord)
                potential[slot.leaf_ix] = potential.get(slot.leaf_ix, 0) + 1
            continue
        if sum(g for _, g in hs) + len(slot.free) != slot.gpus:
            continue  # GPUs held by something the snapshot does not show: cannot be freed
        needed: list[int] = []
        waits: list[int] = []
        ok = True
        for i, _g in hs:
            if i in pend:
                waits.append(i)
            elif eligible is not None and eligible(i):
                needed.append(i)
            else:
                ok = False
                break
        if not ok or not usable(slot):
            continue
        if needed:
            need_of[slot.ord] = needed
        else:
            free_now.append(slot.ord)
        potential[slot.leaf_ix] = potential.get(slot.leaf_ix, 0) + 1
        waits_of[slot.ord] = waits
    return _Candidates(free_now, need_of, {}, waits_of, potential)


def _free_greedily(cand: _Candidates, index: FreeIndex, table: RunningTable, nodes: int) -> list[int] | None:
    """The nodes free now, then nodes needing the fewest remaining victims (least lost, on the
    leaf with most potential, node order) until ``nodes`` are free; a victim spanning several
    nodes frees them all. None: the zone cannot free enough."""
    freed = list(cand.free_now)
    if len(freed) >= nodes:
        return freed
    need_of, lost_of, lost = cand.need_of, cand.lost_of, table.lost
    potential = cand.potential
    remaining: dict[int, int] = {}
    rem_lost: dict[int, float] = {}
    heap = []  # every entry differs (by node), so the pops do not depend on the order built
    slots = index.slots
    for o, v in need_of.items():
        k = remaining[o] = len(v)
        lo = rem_lost[o] = lost_of[o] if o in lost_of else sum(lost[i] for i in v)
        heap.append((k, lo, -potential[slots[o].leaf_ix], o))
    heapq.heapify(heap)
    done: dict[int, bool] = {}
    chosen_mark: dict[int, bool] = {}
    while len(freed) < nodes and heap:
        cnt, lst, _pot, o = heapq.heappop(heap)
        if done.get(o) or cnt != remaining[o] or lst != rem_lost[o]:
            continue  # stale entry
        for i in need_of[o]:
            if chosen_mark.get(i):
                continue
            chosen_mark[i] = True
            for o2 in table.nodes_of[i]:
                if o2 in need_of and not done.get(o2):
                    remaining[o2] -= 1
                    rem_lost[o2] -= lost[i]
                    if remaining[o2] == 0:
                        done[o2] = True
                        freed.append(o2)
                    else:
                        heapq.heappush(heap, (remaining[o2], rem_lost[o2], -potential[index.slots[o2].leaf_ix], o2))
        if not done.get(o):  # all its blockers are chosen now
            done[o] = True
            freed.append(o)
    return freed if len(freed) >= nodes else None


def _place_on_freed(
    freed: list[int], cand: _Candidates, index: FreeIndex, table: RunningTable, nodes: int
) -> tuple[list[int], list[int], list[int], int] | None:
    """Place on the freed nodes: fewest leaves, tightest fit; inside a leaf, nodes free now
    first, then those needing fewer victims. (victims by job id, nodes, jobs already suspending
    there, leaves) or None."""
    need_of, lost, jobs = cand.need_of, table.lost, table.jobs
    per_leaf: dict[int, list[int]] = {}
    for o in sorted(freed):
        per_leaf.setdefault(index.slots[o].leaf_ix, []).append(o)
    counts = [(len(v), li) for li, v in sorted(per_leaf.items())]
    choice = choose_leaves(counts, nodes)
    if choice is None:
        return None
    picked: list[int] = []
    for li, take in choice:
        ordered = sorted(
            per_leaf[li], key=lambda o: (len(need_of.get(o, ())), sum(lost[i] for i in need_of.get(o, ())), o)
        )
        picked.extend(ordered[:take])
    victims: list[int] = []
    vmark: dict[int, bool] = {}
    waiting: list[int] = []
    for o in picked:
        for i in cand.waits_of.get(o, ()):
            if i not in waiting:
                waiting.append(i)
        for i in need_of.get(o, ()):
            if not vmark.get(i):
                vmark[i] = True
                victims.append(i)
    victims.sort(key=lambda i: jobs[i].id)
    return victims, picked, waiting, len(choice)
