"""The victim table: per-cycle facts about the running jobs that matter to victim choice.

Built once per cycle (``victims.VictimFacts.table``) from the jobs that could be victims in it,
and read by the planners (``preemption``): GPUs per node and job, GPU-seconds each would lose,
who already suspends for whom, the victims chosen so far in this cycle (``chosen``, the only
thing that changes), and two per-cycle indexes built on first use: every (possible victim,
node) pair by size and lost work (``singles``) and each zone's nodes that could be freed
(``zones``).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from operator import itemgetter
from typing import NamedTuple

from hai.domain.scheduler.model import Policy, RunningJob
from hai.domain.scheduler.placement import FreeIndex, NodeSlot

_FIRST = itemgetter(0)
_SECOND = itemgetter(1)

# The two records below are built by the thousand each cycle and scanned in the planners' inner
# loops, so they are plain tuples with a fixed layout (a NamedTuple costs ~4% of a Fire-Flyer
# cycle: a Python frame to build each, the slow path to unpack them); every use unpacks them
# into the field names given here.

VictimOnNode = tuple[float, int, int, int, int]
"""One (possible victim, node) pair: (lost, gpus, node, job_id, job) = GPU-seconds since the
victim's last checkpoint, its GPUs on this node, the node's ord, its job id, its index into
``RunningTable.jobs``. Tuples order by lost work first."""

FreeableNode = tuple[int, tuple[int, ...], float, int, int]
"""A node every holder of which is past its minimum runtime (and not suspending): (node,
blockers, lost, top_rank, top_young_rank) = the node's ord, the jobs on it (indices), their lost
GPU-seconds together, the highest effective rank among them, the highest rank among those not
past the quantum (-1: none)."""


_Place = tuple[RunningJob, int, int, tuple[int, ...], float, "int | None", "tuple[tuple[int, int], ...]", bool]
"""Where a running job runs, as the victim table reads it: (the job, its GPUs, the ord of its
one node or -1 (several allocations, or a node outside the index), its nodes' ords (in the order
of its allocations, each once; those outside the index left out), when its lost work began
(last checkpoint, else start), the queued job it suspends for or None, and for -1 its GPUs on
each of those nodes as (ord, GPUs) (two allocations on one node summed), and whether it had two
allocations on one node). The job is held so that its id is not reused while the entry lives."""


class KeptPlaces:
    """The running jobs' places (``_Place``), kept across cycles by the caller
    (``kept.KeptQueue.places``; issue 12). A running job's row is a frozen object, and a changed
    row a new one, so an entry keyed by the object's id (the entry holds the object) stays true
    for as long as the node layout its ords index is the same; a cycle reads the place of each
    job it indexes from here instead of from its allocations (~30% of the table's build at 10k
    nodes). Entries of jobs that left are dropped once they outnumber a quarter of the running
    jobs; another layout drops them all."""

    __slots__ = ("layout", "of", "cleared")

    def __init__(self) -> None:
        self.layout: object = None
        self.of: dict[int, _Place] = {}
        self.cleared = 0  # (for tests) times every entry was dropped (another layout)

    def known(self, index: FreeIndex, running: Sequence[RunningJob]) -> dict[int, _Place]:
        """The entries, valid for ``index``'s layout, with those of departed jobs dropped when
        they are many."""
        of = self.of
        if self.layout is not index.layout:
            if of:
                self.cleared += 1
            self.of = of = {}
            self.layout = index.layout
        elif len(of) > len(running) + len(running) // 4 + 64:
            get = of.get
            self.of = of = {id(r): e for r in running if (e := get(id(r))) is not None}
        return of


class SortedPairs:
    """(Possible victim, node) pairs (or any tuples: a zone's order) in their order (least
    first), sorted only as far as they are read: iterating yields them in order, popping a heap
    on demand (a plan reads the first few of ~20,000 pairs; sorting them all was most of
    ``singles``' cost), made a heap on the first read (a 10k cycle reads 5 of its 6: the sixth,
    ~5,500 pairs, was heapified for nothing). ``unordered``: all of them in no particular order."""

    __slots__ = ("done", "heap", "_fit", "_heaped")

    def __init__(self, pairs: list[VictimOnNode]):
        self.heap = pairs
        self._heaped = False  # ``heap`` made a heap (``at``, on its first pop)
        self.done: list[VictimOnNode] = []  # the least ones, in order
        # a job's GPUs -> [the pairs read so far whose node could hold it beside the victim, in
        # order; how many pairs of the order were read for it] (``fitting``)
        self._fit: dict[int, list] = {}

    def __iter__(self) -> Iterator[VictimOnNode]:
        if not self.heap:
            return iter(self.done)
        return self._reading()

    def _reading(self) -> Iterator[VictimOnNode]:
        k = 0
        while (e := self.at(k)) is not None:
            yield e
            k += 1

    def at(self, k: int) -> VictimOnNode | None:
        """The ``k``-th pair in order (None past the last), sorted as far as that: popped from
        the heap one by one, and past the first 64 (read deep: plans whose first pairs do not
        fit) the rest sorted at once."""
        done, heap = self.done, self.heap
        while k >= len(done):
            if not heap:
                return None
            if len(done) >= 64:
                heap.sort()
                done.extend(heap)
                heap.clear()
            else:
                if not self._heaped:
                    heapq.heapify(heap)
                    self._heaped = True
                done.append(heapq.heappop(heap))
        return done[k]

    def fitting(self, gpus: int, victim_gpus: int, slots: Sequence[NodeSlot]) -> Iterator[VictimOnNode]:
        """The pairs in order, less those whose node cannot hold a job of ``gpus`` GPUs on one
        node beside this bucket's victims (``victim_gpus`` each): the node has fewer GPUs, or
        fewer free than the job needs beyond the victim's. A node's free GPUs only shrink
        during a cycle, so a pair that failed once fails for the rest of it: each job size reads
        the order past such pairs once a cycle, not once a plan (a plan of 8 GPUs read every
        pair of the 1-GPU victims, ~6,500 at 10k nodes, and found none that fit). Read past the
        first 64 pairs, the pairs still in the heap are checked all at once and only those that
        fit are sorted (not every pair, for a job size few nodes can hold). The pairs yielded
        are checked again by the caller (free GPUs may have shrunk since)."""
        got = self._fit.get(gpus)
        if got is None:
            got = self._fit[gpus] = [[], 0]
        keep: list[VictimOnNode] = got[0]
        need = gpus - victim_gpus
        k = 0
        done, heap = self.done, self.heap
        while True:
            if k == len(keep):
                p = got[1]
                while True:
                    if p >= len(done):
                        if p >= len(done) + len(heap):
                            break  # every pair read for this size
                        if p >= 64:  # deep: the rest that fits, sorted (p == len(done) here)
                            p = len(done) + len(heap)
                            keep.extend(sorted([e for e in heap if (s := slots[e[2]]).gpus >= gpus and len(s.free) >= need]))
                            break
                    e = self.at(p)
                    if e is None:
                        break
                    p += 1
                    slot = slots[e[2]]
                    if slot.gpus >= gpus and len(slot.free) >= need:
                        keep.append(e)
                        break
                got[1] = p
                if k == len(keep):
                    return
            yield keep[k]
            k += 1

    def __len__(self) -> int:
        return len(self.done) + len(self.heap)

    def unordered(self) -> Iterator[VictimOnNode]:
        return chain(self.done, self.heap)


class ZoneClasses(NamedTuple):
    idle: list[int]  # nodes holding no indexed job
    freeable: list[FreeableNode]
    # (``order``, filled on first use in the cycle) the freeable nodes that a waiting job of
    # (rank, time-sharing) may free by rank, cheapest first: (victims, lost, node), sorted as read
    orders: dict[tuple[int, bool], SortedPairs]
    by_leaf: dict[int, list[FreeableNode]]  # leaf index -> its freeable nodes
    entry_of: dict[int, FreeableNode]  # node -> its entry in ``freeable``
    idle_free: list[list[int] | None]  # (``free_idle``, filled on first use in the cycle)

    def free_idle(self, slots: Sequence[NodeSlot]) -> list[int]:
        """In node order: the ``idle`` nodes that had every GPU free when first asked in this
        cycle; a superset of those free at any later ask (free GPUs only shrink during a cycle,
        as ``RunningTable.idle_nodes``). Most nodes of no indexed job hold a job not past its
        minimum runtime (~430 a zone at 10k nodes), and every plan looked at each of them."""
        got = self.idle_free[0]
        if got is None:
            got = self.idle_free[0] = [o for o in self.idle if len(slots[o].free) == slots[o].gpus]
        return got

    def order(self, rank: int, time_sharing: bool) -> SortedPairs:
        """The freeable nodes whose jobs a waiting job of ``rank`` may suspend by rank (every top
        rank below ``rank``; with time-sharing also equal, when every job at ``rank`` there is
        past the quantum), as (victims, lost GPU-seconds, node) in that order: the order in
        which ``preemption._free_greedily`` frees nodes, before the leaf's potential. Sorted only
        as far as it is read (``SortedPairs``: a plan reads the cheapest few of ~4,500 nodes a
        zone at 10k nodes; sorting them all was a third of the zones' cost)."""
        key = (rank, time_sharing)
        got = self.orders.get(key)
        if got is None:
            got = self.orders[key] = SortedPairs([
                (len(b), lost, o)
                for o, b, lost, top, top_young in self.freeable
                if top < rank or (time_sharing and top == rank and top_young < rank)
            ])
        return got


class RunningTable:
    """Per-cycle facts about the running jobs that matter to victim choice.

    Only ``members`` are indexed: jobs that could be victims in this cycle (past their
    minimum runtime and below some queued job's priority, or past the quantum) and jobs
    already suspending for a queued job. A node holding GPUs of any other job cannot be freed
    (its holders do not add up to its GPUs), which is exactly the rule.
    """

    def __init__(
        self,
        jobs: Sequence[RunningJob],
        eff_rank: list[int],
        min_ok: list[bool],
        quantum_ok: list[bool],
        members: list[int],
        policy: Policy,
        now: float,
        index: FreeIndex,
        places: KeptPlaces | None = None,
    ):
        self.jobs = jobs
        self.members = members
        self.rank = eff_rank
        self.min_ok = min_ok
        self.quantum_ok = quantum_ok
        self.now = now
        n = len(jobs)
        self.gpus = [0] * n
        self.lost = [0.0] * n
        self.chosen = [False] * n
        holders: list[list[tuple[int, int]]] = [[] for _ in index.slots]
        self.holders = holders
        # the nodes of each indexed job (a tuple; the empty one for the others)
        self.nodes_of: list[tuple[int, ...]] = [()] * n
        self.pending_for: dict[int, list[int]] = {}
        self._singles: dict[int, SortedPairs] | None = None
        self._zones: list[ZoneClasses] | None = None
        self._idle: list[list[int]] | None = None
        self._with_free: list[int] | None = None
        self._eligible: dict[tuple[int, str, bool], Callable[[int], bool]] = {}
        self.pending_mark = [False] * n
        by_name = index.by_name
        held = [0] * len(holders)  # GPUs held on each node by the indexed jobs
        # every (job, node) pair of ``holders`` whose job is past its minimum runtime, as
        # ``singles`` reads them (made here, in the pass over the jobs, not in a second pass);
        # None when a job holds two allocations on one node (merged in ``holders``: rare,
        # built from there)
        pairs: list[VictimOnNode] = []
        pairs_ok = True
        pair = pairs.append
        min_ok = self.min_ok
        nodes_of, gpus, lost, pending_for = self.nodes_of, self.gpus, self.lost, self.pending_for
        # each job's place, read from the job object once and kept across cycles when the caller
        # keeps them (``KeptPlaces``): (job, GPUs, node ord or -1, its nodes, since, suspending for)
        known = places.known(index, jobs) if places is not None else None
        known_get = known.get if known is not None else {}.get
        for i in members:
            j = jobs[i]
            e = known_get(id(j))
            if e is None:  # (inline: a call per job cost ~1% of a cycle without kept places)
                allocs = j.allocations
                ckpt = j.last_checkpoint_at
                t0 = j.started_at if ckpt is None else ckpt
                slot = by_name.get(allocs[0].node) if len(allocs) == 1 else None
                if slot is not None:
                    e = (j, len(allocs[0].gpus), slot.ord, (slot.ord,), t0, j.suspend_requested_for, (), False)
                else:  # several allocations (or a node outside the index): GPUs per node, summed
                    on: dict[int, int] = {}
                    g = n_in = 0
                    for a in allocs:
                        k = len(a.gpus)
                        g += k
                        slot = by_name.get(a.node)
                        if slot is not None:
                            n_in += 1
                            on[slot.ord] = on.get(slot.ord, 0) + k
                    e = (j, g, -1, tuple(on), t0, j.suspend_requested_for, tuple(on.items()), len(on) < n_in)
                if known is not None:
                    known[id(j)] = e
            _j, g, o, nodes, t0, target, per_node, twice = e
            gpus[i] = g
            since = now - t0
            lo = lost[i] = g * since if since > 0.0 else 0.0  # (as g * max(0.0, since))
            if o >= 0:  # (most jobs: one allocation, on a node of the index)
                held[o] += g
                holders[o].append((i, g))
                nodes_of[i] = nodes
                if min_ok[i]:
                    pair((lo, g, o, j.id, i))
            else:  # several nodes: the GPUs on each, read with the place
                for o, k in per_node:
                    held[o] += k
                    holders[o].append((i, k))
                    if min_ok[i]:
                        pair((lo, k, o, j.id, i))
                nodes_of[i] = nodes
                if twice:  # two allocations on one node: ``singles`` makes the pairs from ``holders``
                    pairs_ok = False
            if target is not None:
                pending_for.setdefault(target, []).append(i)
                self.pending_mark[i] = True
        self.held = held
        self._pairs: list[VictimOnNode] | None = pairs if pairs_ok else None

    def runtime(self, i: int) -> float:
        """How long job ``i`` has run (its explanation)."""
        return self.now - self.jobs[i].started_at

    def singles(self) -> dict[int, SortedPairs]:
        """GPUs on the node -> every (possible victim, node) pair with that many GPUs, least lost
        first (``SortedPairs``: sorted as far as it is read); largest buckets first. Built once
        per cycle; a waiting job scans it with its own eligibility test, so a single-victim plan
        is found in the first entries instead of a scan of every node."""
        got = self._singles
        if got is None:
            jobs, min_ok, lost = self.jobs, self.min_ok, self.lost
            # each (job, node) pair once (no two pairs are equal: they differ by node or job)
            if self._pairs is not None:
                flat, self._pairs = self._pairs, None  # (made by the table's build; sorted below)
            else:
                flat = []
                for o, hs in enumerate(self.holders):
                    for i, g in hs:
                        if min_ok[i]:
                            flat.append((lost[i], g, o, jobs[i].id, i))
            # by the victim's GPUs on the node, largest first
            sizes = sorted(set(map(_SECOND, flat)), reverse=True)
            if len(sizes) == 1:
                got = {sizes[0]: SortedPairs(flat)}
            else:
                flat.sort(key=_SECOND)  # stable: each size's pairs in one run
                got = {}
                start = 0
                for g in sorted(sizes):
                    end = bisect_right(flat, g, lo=start, key=_SECOND)
                    got[g] = SortedPairs(flat[start:end])
                    start = end
                got = {g: got[g] for g in sizes}
            self._singles = got
        return got

    def zones(self, index: FreeIndex) -> list[ZoneClasses]:
        """Per zone: the nodes holding no indexed job, and the nodes every job of which is past
        its minimum runtime (and not suspending). Built once per cycle; a waiting job of rank R
        may free a node when its top rank is below R, or (time-sharing) equal to R with every
        job at R past the quantum (and of other users: checked live, with the victims already
        chosen and the reservations)."""
        got = self._zones
        if got is not None:
            return got
        ranks, min_ok, q_ok, holders, lost = self.rank, self.min_ok, self.quantum_ok, self.holders, self.lost
        pending = self.pending_mark
        got = []
        start = 0
        for z in range(len(index.zones)):
            size = index.zone_size[z]
            idle: list[int] = []
            freeable: list[FreeableNode] = []
            for o in range(start, start + size):
                hs = holders[o]
                if not hs:
                    idle.append(o)
                    continue
                if len(hs) == 1:  # (most nodes: one job) as the loop below, ranks being >= 0
                    i = hs[0][0]
                    if not pending[i] and min_ok[i]:
                        r = ranks[i]
                        freeable.append((o, (i,), lost[i], r, -1 if q_ok[i] else r))
                    continue
                top = top_young = -1
                for i, _g in hs:
                    if pending[i] or not min_ok[i]:
                        break
                    r = ranks[i]
                    if r > top:
                        top = r
                    if not q_ok[i] and r > top_young:
                        top_young = r
                else:
                    blockers = tuple(map(_FIRST, hs))
                    freeable.append((o, blockers, sum(map(lost.__getitem__, blockers)), top, top_young))
            by_leaf: dict[int, list[FreeableNode]] = {}
            leaf_of = index.leaf_of
            for e in freeable:
                li = leaf_of[e[0]]
                at = by_leaf.get(li)
                if at is None:
                    by_leaf[li] = [e]
                else:
                    at.append(e)
            got.append(ZoneClasses(idle, freeable, {}, by_leaf, dict(zip(map(_FIRST, freeable), freeable)), [None]))
            start += size
        self._zones = got
        return got

    def idle_nodes(self, index: FreeIndex) -> list[list[int]]:
        """Per zone, in node order: the nodes that hold no indexed job and had every GPU free
        when first asked in this cycle. A superset of the nodes idle at any later ask: free
        GPUs only shrink during a cycle (``FreeIndex.take``). Built once per cycle, on first
        use (``preemption._free_now_plan``)."""
        got = self._idle
        if got is None:
            holders, slots = self.holders, index.slots
            got = []
            start = 0
            for size in index.zone_size:
                got.append([o for o in range(start, start + size) if not holders[o] and len(slots[o].free) == slots[o].gpus])
                start += size
            self._idle = got
        return got

    def nodes_with_free(self, index: FreeIndex) -> list[int]:
        """In node order: the nodes that had a free GPU when first asked in this cycle (a
        superset of those with free GPUs at any later ask, as ``idle_nodes``). Built once per
        cycle, on first use (``preemption._fewest_victims_on_a_node``)."""
        got = self._with_free
        if got is None:
            got = self._with_free = [s.ord for s in index.slots if s.free]
        return got

    def eligible_fn(self, rank: int, user: str, time_sharing: bool) -> Callable[[int], bool]:
        key = (rank, user if time_sharing else "", time_sharing)
        got = self._eligible.get(key)
        if got is None:
            got = self._eligible[key] = self._make_eligible(rank, user, time_sharing)
        return got

    def _make_eligible(self, rank: int, user: str, time_sharing: bool) -> Callable[[int], bool]:
        """``victims.outranks`` and (time-sharing) ``victims.may_take_turn``, inline (called
        for every candidate victim of every plan)."""
        ranks, jobs, chosen, min_ok, q_ok = self.rank, self.jobs, self.chosen, self.min_ok, self.quantum_ok

        if time_sharing:

            def eligible(i: int) -> bool:
                if chosen[i] or not min_ok[i]:
                    return False
                r = ranks[i]
                if r < rank:
                    return True
                return r == rank and q_ok[i] and jobs[i].user != user

        else:

            def eligible(i: int) -> bool:
                return min_ok[i] and not chosen[i] and ranks[i] < rank

        return eligible
