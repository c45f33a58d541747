"""Placement: a free-capacity index over the cluster and the fat-tree placement rules.

Rules, in order (issue 3):

1. a job never spans zones (unless it allows it; the caller enforces "one such job at a time");
2. a multi-node job takes whole idle nodes on the fewest leaf switches possible, and among
   equal choices the tightest fit, so large free blocks stay whole;
3. a job on one node packs onto partly used nodes (best fit: fewest free GPUs that suffice)
   before it breaks an idle node, and when it must break one, it takes it from the leaf with
   the fewest idle nodes, so big idle blocks stay whole;
4. unschedulable nodes are never indexed, so they get nothing;
5. every choice ends in a total order on (zone, leaf, node name): the same snapshot gives the
   same placement.

The index is rebuilt each cycle from the snapshot's nodes (the snapshot is never mutated) and
updated as the cycle hands GPUs out, so one decision costs O(GPUs per node + leaves), not
O(nodes). Nothing here iterates a set or a dict of sets to decide anything.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import is_not

from hai.domain.scheduler.model import NodeView


class NodeSlot:
    """One schedulable node's mutable state during a cycle (a copy; the NodeView is untouched)."""

    __slots__ = ("free", "gpus", "indexed", "leaf", "leaf_ix", "name", "ord", "zone", "zone_ix")

    def __init__(self, ord_: int, view: NodeView, zone_ix: int, leaf_ix: int):
        self.ord = ord_
        self.name = view.name
        self.zone = view.zone
        self.leaf = view.leaf
        self.zone_ix = zone_ix
        self.leaf_ix = leaf_ix
        gpus = self.gpus = view.gpus
        free = list(view.free_gpus)  # sorted, as NodeView promises
        if free and (free[0] < 0 or free[-1] >= gpus or len(free) > gpus):
            free = sorted(g for g in set(free) if 0 <= g < gpus)
        self.free: list[int] = free
        self.indexed = False

    @property
    def idle(self) -> bool:
        return len(self.free) == self.gpus


class _Layout:
    """The static shape of a node list: order by (zone, leaf, name) and the zone/leaf tables.
    Pure function of the (name, zone, leaf) of each node, memoized because a live cluster and
    the simulator present the same node list cycle after cycle."""

    __slots__ = (
        "leaf_of",
        "leaves",
        "names",
        "order",
        "slot_leaf",
        "slot_zone",
        "sorted_names",
        "leaf_size",
        "zone_leaves",
        "zone_of",
        "zone_size",
        "zones",
    )  # fmt: skip

    def __init__(self, views: Sequence[NodeView]):
        self.names = tuple(v.name for v in views)
        self.zone_of = tuple(v.zone for v in views)
        self.leaf_of = tuple(v.leaf for v in views)
        self.order = sorted(range(len(views)), key=lambda i: (views[i].zone, views[i].leaf, views[i].name))
        self.sorted_names = [views[i].name for i in self.order]
        self.zones: list[str] = []
        self.leaves: list[tuple[str, str, int]] = []  # (leaf name, zone, zone ix)
        self.zone_leaves: list[list[int]] = []
        self.slot_zone: list[int] = []
        self.slot_leaf: list[int] = []
        leaf_ix_of: dict[tuple[str, str], int] = {}
        for i in self.order:
            v = views[i]
            if not self.zones or self.zones[-1] != v.zone:
                self.zones.append(v.zone)
                self.zone_leaves.append([])
            zone_ix = len(self.zones) - 1
            key = (v.zone, v.leaf)
            leaf_ix = leaf_ix_of.get(key)
            if leaf_ix is None:
                leaf_ix = len(self.leaves)
                leaf_ix_of[key] = leaf_ix
                self.leaves.append((v.leaf, v.zone, zone_ix))
                self.zone_leaves[zone_ix].append(leaf_ix)
            self.slot_zone.append(zone_ix)
            self.slot_leaf.append(leaf_ix)
        # nodes per leaf and per zone (the index's sizes; a pass of their own cost ~3 ms of a 10k cycle)
        self.leaf_size = [0] * len(self.leaves)
        self.zone_size = [0] * len(self.zones)
        for li in self.slot_leaf:
            self.leaf_size[li] += 1
        for zi in self.slot_zone:
            self.zone_size[zi] += 1


_LAYOUTS: dict[tuple[str, ...], _Layout] = {}


def _layout(views: Sequence[NodeView]) -> _Layout:
    names = tuple([v.name for v in views])
    lay = _LAYOUTS.get(names)
    if lay is not None and (tuple([v.zone for v in views]) != lay.zone_of or tuple([v.leaf for v in views]) != lay.leaf_of):
        lay = None  # a node moved to another zone or leaf
    if lay is None:
        lay = _Layout(views)
        if len(_LAYOUTS) >= 8:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[names] = lay
    return lay


class KeptSlots:
    """The node slots of the last cycle, kept by the caller for the next (issue 12; owned by
    ``kept.KeptQueue``). A cycle builds a ``NodeSlot`` per schedulable node (~4 ms of a 10k
    cycle), although between two cycles only the nodes whose view changed (GPUs given out or
    back, a node's state) and the nodes the last cycle handed GPUs out from differ. A slot is a
    copy of its view: ``free`` (the only field a cycle changes, in ``FreeIndex.take``, which
    records the slot here) and ``indexed`` (set for every slot by ``FreeIndex.fill``). So a slot
    whose view is the very object it was built from (views are frozen) and that no cycle took
    GPUs from since is the slot a new build would make, and is used again; every other slot is
    built again. A view list of another length, a changed view with another name, zone or leaf
    (another layout), or more than a quarter of the views new objects, is built in full."""

    __slots__ = ("built", "by_name", "gpus", "layout", "rebuilt", "slots", "taken", "views", "where")

    def __init__(self) -> None:
        self.views: list[NodeView] | None = None  # the views of the last build, in the caller's order
        self.layout: _Layout | None = None
        self.where: list[int] = []  # position in ``views`` -> the slot's ord
        self.slots: list[NodeSlot] = []
        self.by_name: dict[str, NodeSlot] = {}
        self.gpus: list[int] = []  # each slot's GPUs
        self.taken: list[int] = []  # ords of the slots handed GPUs out from since the last build
        self.built = 0  # (for tests and benchmarks) full builds
        self.rebuilt = 0  # slots built again by the last reuse

    def _reuse(self, views: list[NodeView]) -> _Layout | None:
        """Bring the kept slots up to ``views``; the layout, or None (build in full)."""
        old, lay = self.views, self.layout
        if old is None or lay is None or len(old) != len(views):
            return None
        changed = list(compress(range(len(views)), map(is_not, views, old)))
        if len(changed) * 4 > len(views):
            return None  # most views are new objects (a caller that builds them all each cycle)
        names, zones, leaves = lay.names, lay.zone_of, lay.leaf_of
        for p in changed:
            v = views[p]
            if v.name != names[p] or v.zone != zones[p] or v.leaf != leaves[p]:
                return None  # another layout
        where = self.where
        redo = set(self.taken)
        redo.update(map(where.__getitem__, changed))
        self.taken.clear()
        slots, by_name, gpus, order = self.slots, self.by_name, self.gpus, lay.order
        slot_zone, slot_leaf = lay.slot_zone, lay.slot_leaf
        for k in redo:
            s = slots[k] = NodeSlot(k, views[order[k]], slot_zone[k], slot_leaf[k])
            by_name[s.name] = s
            gpus[k] = s.gpus
        self.views = views
        self.rebuilt = len(redo)
        return lay

    def _store(self, views: list[NodeView], lay: _Layout, slots: list[NodeSlot], by_name: dict[str, NodeSlot],
               gpus: list[int]) -> None:
        if lay is not self.layout:
            where = [0] * len(views)
            for k, i in enumerate(lay.order):
                where[i] = k
            self.where = where
        self.views, self.layout, self.slots, self.by_name, self.gpus = views, lay, slots, by_name, gpus
        self.taken.clear()
        self.built += 1
        self.rebuilt = len(slots)


class LeafInfo:
    __slots__ = ("idle", "ix", "name", "size", "zone", "zone_ix")

    def __init__(self, ix: int, name: str, zone: str, zone_ix: int):
        self.ix = ix
        self.name = name
        self.zone = zone
        self.zone_ix = zone_ix
        self.idle: list[int] = []  # ords of indexed idle nodes, sorted
        self.size = 0  # schedulable nodes on this leaf


@dataclass(frozen=True)
class Placement:
    """The nodes (and how many GPUs on each) a job would take; not yet taken."""

    slots: tuple[NodeSlot, ...]
    gpus_per_node: int
    leaves: int
    reason: str


class FreeIndex:
    """Free capacity of the schedulable nodes, by leaf (idle nodes) and by free-GPU count
    (partly used nodes). A node can be left out of the index (reserved for a job) and put
    back; its ``free`` list stays exact either way.

    ``kept``: the slots kept from the last cycle (``KeptSlots``), used again where they equal
    what this build would make, and kept for the next."""

    def __init__(self, nodes: Iterable[NodeView], kept: KeptSlots | None = None):
        views = list(nodes)
        lay = kept._reuse(views) if kept is not None else None
        if lay is None:
            lay = _layout(views)
        self.zones: list[str] = list(lay.zones)
        self.leaves: list[LeafInfo] = [LeafInfo(ix, name, zone, zix) for ix, (name, zone, zix) in enumerate(lay.leaves)]
        for leaf, size in zip(self.leaves, lay.leaf_size):
            leaf.size = size
        self.zone_leaves: list[list[int]] = lay.zone_leaves  # read-only
        self.zone_size = list(lay.zone_size)
        self.leaf_of: list[int] = lay.slot_leaf  # slot ord -> its leaf's index (read-only)
        self.layout: object = lay  # (identity only) the node layout the slots' ords index
        if kept is not None and kept.layout is lay and kept.views is views:  # (reused)
            slots, by_name, gpus = kept.slots, kept.by_name, kept.gpus
        else:
            slot_zone, slot_leaf = lay.slot_zone, lay.slot_leaf
            slots = [NodeSlot(k, views[i], slot_zone[k], slot_leaf[k]) for k, i in enumerate(lay.order)]
            gpus = [s.gpus for s in slots]
            by_name = dict(zip(lay.sorted_names, slots))
            if kept is not None:
                kept._store(views, lay, slots, by_name, gpus)
        # the ords of the slots GPUs are taken from (a kept slot is built again after that)
        self._taken: list[int] | None = kept.taken if kept is not None else None
        self.slots = slots
        self.by_name: dict[str, NodeSlot] = by_name
        self.max_gpus = max(0, max(gpus, default=0))
        self.homogeneous = not gpus or gpus.count(gpus[0]) == len(gpus)  # every node as many GPUs
        # partial[f]: ords of indexed nodes with exactly f free GPUs, 0 < f < gpus
        self.partial: list[list[int]] = [[] for _ in range(self.max_gpus + 1)]
        self.zone_idle = [0] * len(self.zones)

    # -- maintenance -------------------------------------------------------------------------
    def fill(self, leave_out: dict[str, int]) -> None:
        """Index every node not named in ``leave_out`` (bulk, in node order: appends only)."""
        partial, leaves, zone_idle = self.partial, self.leaves, self.zone_idle
        for slot in self.slots:
            if slot.name in leave_out:
                slot.indexed = False  # (a kept slot may have been indexed in the last cycle)
                continue
            slot.indexed = True
            f = len(slot.free)
            if f == 0:
                continue
            if f == slot.gpus:
                leaves[slot.leaf_ix].idle.append(slot.ord)
                zone_idle[slot.zone_ix] += 1
            else:
                partial[f].append(slot.ord)

    def insert(self, slot: NodeSlot) -> None:
        if slot.indexed:
            return
        slot.indexed = True
        f = len(slot.free)
        if f == 0:
            return
        if f == slot.gpus:
            insort(self.leaves[slot.leaf_ix].idle, slot.ord)
            self.zone_idle[slot.zone_ix] += 1
        else:
            insort(self.partial[f], slot.ord)

    def remove(self, slot: NodeSlot) -> None:
        if not slot.indexed:
            return
        slot.indexed = False
        f = len(slot.free)
        if f == 0:
            return
        if f == slot.gpus:
            lst = self.leaves[slot.leaf_ix].idle
            del lst[bisect_left(lst, slot.ord)]
            self.zone_idle[slot.zone_ix] -= 1
        else:
            lst = self.partial[f]
            del lst[bisect_left(lst, slot.ord)]

    def take(self, slot: NodeSlot, count: int) -> tuple[int, ...]:
        """Hand out the ``count`` lowest free GPUs of ``slot`` (keeps the index consistent)."""
        was = slot.indexed
        self.remove(slot)
        gpus = tuple(slot.free[:count])
        if len(gpus) != count:
            raise ValueError(f"node {slot.name} has {len(slot.free)} free GPUs, {count} asked")
        del slot.free[:count]
        if self._taken is not None:
            self._taken.append(slot.ord)
        if was:
            self.insert(slot)
        return gpus

    # -- queries -----------------------------------------------------------------------------
    def max_free_partial(self) -> int:
        for f in range(len(self.partial) - 1, 0, -1):
            if self.partial[f]:
                return f
        return 0

    def largest_idle_gpus(self) -> int:
        best = 0
        for leaf in self.leaves:
            for o in leaf.idle:
                best = max(best, self.slots[o].gpus)
                if self.homogeneous:
                    break
        return best

    def qualifying_idle(self, leaf: LeafInfo, gpus_per_node: int) -> list[int]:
        if self.homogeneous and (not leaf.idle or self.slots[leaf.idle[0]].gpus >= gpus_per_node):
            return leaf.idle
        return [o for o in leaf.idle if self.slots[o].gpus >= gpus_per_node]

    def leaf_counts(self, zone_ix: int | None, gpus_per_node: int) -> list[tuple[int, int]]:
        """(idle qualifying nodes, leaf ix) for the leaves of one zone (or all zones)."""
        leaf_ixs: Sequence[int] = range(len(self.leaves)) if zone_ix is None else self.zone_leaves[zone_ix]
        out = []
        for ix in leaf_ixs:
            leaf = self.leaves[ix]
            if leaf.idle:
                c = len(self.qualifying_idle(leaf, gpus_per_node))
                if c:
                    out.append((c, ix))
        return out

    # -- placement ---------------------------------------------------------------------------
    def find_single(self, gpus: int) -> Placement | None:
        """Best fit on one node: the partly used node with the fewest free GPUs that suffice;
        otherwise an idle node from the leaf with the fewest idle nodes."""
        for f in range(gpus, len(self.partial)):
            lst = self.partial[f]
            if lst:
                slot = self.slots[lst[0]]
                left = f - gpus
                return Placement(
                    (slot,),
                    gpus,
                    1,
                    f"best fit: {gpus} GPU(s) on partly used node {slot.name} (leaf {slot.leaf}, zone {slot.zone}),"
                    f" leaving {left} free there; idle nodes stay whole",
                )
        best: tuple | None = None
        best_slot: NodeSlot | None = None
        for leaf in self.leaves:
            if not leaf.idle:
                continue
            cand = self.slots[leaf.idle[0]]
            if cand.gpus < gpus:
                cands = [o for o in leaf.idle if self.slots[o].gpus >= gpus]
                if not cands:
                    continue
                cand = self.slots[min(cands, key=lambda o: (self.slots[o].gpus, o))]
            key = (cand.gpus, len(leaf.idle), self.zone_idle[leaf.zone_ix], leaf.ix)
            if best is None or key < best:
                best = key
                best_slot = cand
        if best_slot is None:
            return None
        leaf = self.leaves[best_slot.leaf_ix]
        return Placement(
            (best_slot,),
            gpus,
            1,
            f"{gpus} GPU(s) on idle node {best_slot.name}: no partly used node had {gpus} free;"
            f" taken from leaf {leaf.name} (zone {leaf.zone}), the one with the fewest idle nodes"
            f" ({len(leaf.idle)}), so larger idle blocks stay whole",
        )

    def find_multi(self, nodes: int, gpus_per_node: int, cross_zone: bool = False) -> Placement | None:
        """Whole idle nodes in one zone (or anywhere when ``cross_zone``), fewest leaves, then
        the tightest fit (least idle capacity left on the leaves used, then the fuller zone)."""
        best: tuple | None = None
        best_choice: list[tuple[int, int]] | None = None
        zones: Sequence[int | None] = [None] if cross_zone else range(len(self.zones))
        for z in zones:
            if z is not None and self.zone_idle[z] < nodes:
                continue
            counts = self.leaf_counts(z, gpus_per_node)
            choice = choose_leaves(counts, nodes)
            if choice is None:
                continue
            cmap = {ix: c for c, ix in counts}
            leftover = sum(cmap[ix] for ix, _ in choice) - nodes
            zone_idle = sum(self.zone_idle) if z is None else self.zone_idle[z]
            key = (len(choice), leftover, zone_idle, -1 if z is None else z)
            if best is None or key < best:
                best = key
                best_choice = choice
        if best_choice is None:
            return None
        slots: list[NodeSlot] = []
        for ix, take in best_choice:
            slots.extend(self.slots[o] for o in self.qualifying_idle(self.leaves[ix], gpus_per_node)[:take])
        leaf_names = ", ".join(self.leaves[ix].name for ix, _ in best_choice)
        zones_used = sorted({s.zone for s in slots})
        where = f"zone {zones_used[0]}" if len(zones_used) == 1 else f"zones {', '.join(zones_used)} (cross-zone allowed)"
        assert best is not None
        return Placement(
            tuple(slots),
            gpus_per_node,
            len(best_choice),
            f"{nodes} whole node(s) on {len(best_choice)} leaf switch(es) ({leaf_names}) in {where}:"
            f" the fewest leaves possible, tightest fit ({best[1]} idle node(s) left on those leaves)",
        )


def min_leaves(counts: Iterable[int], nodes: int) -> int | None:
    """Fewest leaves whose idle nodes add up to ``nodes`` (largest first is optimal)."""
    total = 0
    for m, c in enumerate(sorted(counts, reverse=True), start=1):
        if c <= 0:
            break
        total += c
        if total >= nodes:
            return m
    return None


def choose_leaves(counts: list[tuple[int, int]], nodes: int) -> list[tuple[int, int]] | None:
    """Pick leaves for ``nodes`` whole nodes: the fewest leaves, and among those a tight fit.

    ``counts`` is [(idle nodes, leaf ix)]. Returns [(leaf ix, nodes to take)] or None.
    Heuristic for the tight fit: fill the m-1 non-final leaves with the smallest leaves that
    still let the remaining slots cover the rest, then the final leaf is the smallest that
    covers what is left; all leaves but the last are used completely.
    """
    if nodes <= 0:
        return []
    m = min_leaves((c for c, _ in counts), nodes)
    if m is None:
        return None
    remaining = sorted(counts, key=lambda t: (t[0], t[1]))  # ascending by size, then leaf order
    chosen: list[tuple[int, int]] = []
    need = nodes
    slots_left = m
    while slots_left > 1:
        desc = sorted(remaining, key=lambda t: (-t[0], t[1]))
        prefix = [0]
        for c, _ in desc:
            prefix.append(prefix[-1] + c)
        pos = {ix: i for i, (_, ix) in enumerate(desc)}
        pick = None
        for c, ix in remaining:
            if c >= need:
                continue  # would end early: impossible when m is minimal, kept for safety
            others = slots_left - 1
            top = prefix[others + 1] - c if pos[ix] < others else prefix[others]
            if c + top >= need:
                pick = (c, ix)
                break
        if pick is None:  # cannot happen when m is minimal; fall back to largest-first
            pick = desc[0]
        chosen.append((pick[1], pick[0]))
        need -= pick[0]
        remaining.remove(pick)
        slots_left -= 1
    last = None
    for c, ix in remaining:
        if c >= need:
            last = (c, ix)
            break
    if last is None:
        return None
    chosen.append((last[1], need))
    return chosen
