"""Preemption planning at scale (issue 12): the cheaper ways of the planners must find what the
full ways find. ``preemption._free_lazily`` (a multi-node plan's nodes taken cheapest first
from the zone's per-cycle order, live facts checked only for the nodes reached) frees the same
nodes in the same order as classifying every freeable node of the zone
(``_classified_candidates``) and heaping them all (``_free_greedily``); the (victim, node) pairs
of ``RunningTable.singles`` built from the table's pair lists equal those built node by node.
Checked on every plan of changing snapshots under several policies; an order broken on purpose
is caught."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from hai.domain.jobs import Priority
from hai.domain.scheduler import Policy, schedule
from hai.domain.scheduler import preemption as pre
from hai.domain.scheduler import victim_table as vt
from hai.domain.scheduler.model import FIFO_LEVELS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from scheduler_cycle import NOW, build_snapshot, next_snapshot, with_attained_service  # noqa: E402

POLICIES = {
    "least-attained-service": Policy(),
    "fifo-levels": Policy(**FIFO_LEVELS),
    "no-time-sharing": Policy(**FIFO_LEVELS, time_sharing=False),
    "fifo-capped": Policy(**FIFO_LEVELS, max_preemptions_per_cycle=3, min_runtime_s=1800.0),
}


def _cycles(pol: Policy, seed: int, cycles: int = 4) -> None:
    rng = random.Random(seed)
    snap = with_attained_service(build_snapshot(320, 520, 2500, seed), seed)
    now, next_id = NOW, 10_000_000
    for _ in range(cycles):
        d = schedule(snap, pol, now)
        snap, next_id = next_snapshot(snap, d, now, rng.choice((10.0, 600.0)), rng, 100, 20, next_id)
        now += 600.0


def _classified_candidates(
    zone,
    index,
    table,
    gpus_per_node: int,
    usable,
    same_user,
    rank: int,
    time_sharing: bool,
) -> pre._Candidates:
    """The reference: every freeable node of the zone classified (what plan_multi did before
    ``_free_lazily``): from the per-cycle classification, only live facts checked here (GPUs
    taken by starts in this cycle, victims already chosen, reservations, the user rule)."""
    free_now: list[int] = []
    need_of: dict[int, tuple[int, ...] | list[int]] = {}
    lost_of: dict[int, float] = {}
    potential: dict[int, int] = {}
    slots = index.slots
    for o in zone.idle:
        slot = slots[o]
        if slot.gpus >= gpus_per_node and len(slot.free) == slot.gpus and usable(slot):
            free_now.append(o)
            li = slot.leaf_ix
            potential[li] = potential.get(li, 0) + 1
    held, chosen = table.held, table.chosen
    for o, blockers, lost_sum, top, top_young in zone.freeable:
        if top >= rank and not (time_sharing and top == rank and top_young < rank):
            continue
        slot = slots[o]
        if slot.gpus < gpus_per_node or held[o] + len(slot.free) != slot.gpus:
            continue
        for i in blockers:
            if chosen[i] or (same_user is not None and same_user(i)):
                break
        else:
            if usable(slot):
                need_of[o] = blockers
                lost_of[o] = lost_sum
                li = slot.leaf_ix
                potential[li] = potential.get(li, 0) + 1
    return pre._Candidates(free_now, need_of, lost_of, {}, potential)


def _checking(monkeypatch) -> dict[str, int]:
    """Every lazy multi-node zone plan is compared with the full classification and heap."""
    seen = {"plans": 0, "freed": 0, "differ": 0}
    lazy = pre._free_lazily

    def checked(zone, z, index, table, nodes, gpn, usable, same_user, rank, ts):
        got = lazy(zone, z, index, table, nodes, gpn, usable, same_user, rank, ts)
        cand = _classified_candidates(zone, index, table, gpn, usable, same_user, rank, ts)
        want = None
        if len(cand.free_now) + len(cand.need_of) >= nodes:
            want = pre._free_greedily(cand, index, table, nodes)
        seen["plans"] += 1
        if want is not None:
            seen["freed"] += 1
        same = (got is None) == (want is None) and (
            want is None or (got[0] == want and all(got[1].need_of.get(o, ()) == cand.need_of.get(o, ()) for o in want))
        )
        seen["differ"] += not same
        return got

    monkeypatch.setattr(pre, "_free_lazily", checked)
    return seen


@pytest.mark.parametrize("name", list(POLICIES))
def test_lazy_multi_node_plans_free_what_the_full_classification_frees(monkeypatch, name):
    seen = _checking(monkeypatch)
    for seed in (0, 1):
        _cycles(POLICIES[name], seed)
    assert seen["plans"] > 0 and seen["freed"] > 0  # the comparison ran, on plans that found nodes
    assert seen["differ"] == 0


def test_a_broken_zone_order_is_caught(monkeypatch):
    """The per-cycle order by node only (not by victims and lost work): the lazy planner then
    reaches nodes in another order than the heap, and the comparison sees it."""
    seen = _checking(monkeypatch)

    class InOrder(list):  # read as ``SortedPairs`` is, in the list's own order
        def at(self, k):
            return self[k] if k < len(self) else None

    def by_node(self, rank, time_sharing):
        return InOrder(sorted(
            ((len(b), lost, o) for o, b, lost, top, top_young in self.freeable
             if top < rank or (time_sharing and top == rank and top_young < rank)),
            key=lambda e: e[2],
        ))  # fmt: skip

    monkeypatch.setattr(vt.ZoneClasses, "order", by_node)
    for seed in (0, 1):
        _cycles(POLICIES["fifo-levels"], seed)
    assert seen["differ"] > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_singles_are_every_pair_in_order_however_built(seed):
    """``singles`` from the table's pair lists, read in part and then whole (the heap sorted on
    demand), equals the pairs built node by node and sorted, bucket by bucket, largest first."""
    from hai.domain.scheduler.core import _Cycle

    snap = build_snapshot(320, 520, 2500, seed)
    table = _Cycle(snap, Policy(**FIFO_LEVELS), NOW).facts.table
    assert table._pairs is not None
    fast = table.singles()
    for bucket in fast.values():  # a plan reads the first few
        next(iter(bucket))
    got = {g: list(b) for g, b in fast.items()}
    unordered = {g: sorted(b.unordered()) for g, b in fast.items()}
    want: dict[int, list] = {}
    for o, hs in enumerate(table.holders):
        for i, g in hs:
            if table.min_ok[i]:
                want.setdefault(g, []).append((table.lost[i], g, o, table.jobs[i].id, i))
    want = {g: sorted(want[g]) for g in sorted(want, reverse=True)}
    assert list(got) == list(want) and got == want == unordered and sum(map(len, want.values())) > 0
    table._singles, table._pairs = None, None  # the node-by-node build (a job twice on a node)
    assert {g: list(b) for g, b in table.singles().items()} == want


def _one_victim_reading_every_pair(slots, singles, gpus, usable, eligible, maxfree):  # noqa: ANN001, ANN202
    """The reference for ``preemption._one_victim``: each bucket read in its whole order (every
    pair checked), not through ``SortedPairs.fitting``."""
    best = None
    for g, bucket in singles.items():
        if g + maxfree < gpus:
            continue
        for entry in list(bucket):
            if best is not None and entry > best:
                break
            _lost, _gpus, o, _job_id, i = entry
            slot = slots[o]
            if slot.gpus < gpus or len(slot.free) + g < gpus or not eligible(i) or not usable(slot):
                continue
            best = entry
            break
    return best


@pytest.mark.parametrize("name", list(POLICIES))
def test_single_victim_plans_find_what_reading_every_pair_finds(monkeypatch, name):
    """Every single-victim plan of changing snapshots (its cycle's starts shrinking the free
    GPUs between plans, so ``fitting`` serves later plans from what earlier ones read) picks
    the pair that reading every pair in order picks."""
    seen = {"plans": 0, "found": 0, "differ": 0}
    real = pre._one_victim

    def checked(slots, singles, gpus, usable, eligible, maxfree):  # noqa: ANN001, ANN202
        want = _one_victim_reading_every_pair(slots, singles, gpus, usable, eligible, maxfree)
        got = real(slots, singles, gpus, usable, eligible, maxfree)
        seen["plans"] += 1
        seen["found"] += want is not None
        seen["differ"] += (got is None) != (want is None) or (
            got is not None and (got.victims, [s.ord for s in got.slots]) != ([want[4]], [want[2]]))
        return got

    monkeypatch.setattr(pre, "_one_victim", checked)
    for seed in (0, 1):
        _cycles(POLICIES[name], seed)
    assert seen["plans"] > 0 and seen["found"] > 0
    assert seen["differ"] == 0


def test_fitting_pairs_are_the_order_less_the_nodes_too_small_for_good():
    """``SortedPairs.fitting`` yields, in order, every pair whose node could hold the job now,
    also after free GPUs were taken between two reads (it skips a pair for good only when its
    node failed, which stays failed in a cycle); a pair that fits is never left out. Read past
    the first 64 pairs, the rest that fits is taken from the heap at once: the bucket itself
    is never sorted whole by it, and several sizes read in turn, each partly, agree."""
    from hai.domain.scheduler.core import _Cycle

    snap = build_snapshot(320, 520, 2500, 4)
    cyc = _Cycle(snap, Policy(**FIFO_LEVELS), NOW)
    table, index = cyc.facts.table, cyc.index
    slots = index.slots
    rng = random.Random(4)
    singles = table.singles()
    skipped = 0

    def fitting_now(gpus: int, g: int):  # noqa: ANN202
        """Whether a pair's node could hold a job of ``gpus`` beside its victim of ``g`` now."""
        return lambda e: slots[e[2]].gpus >= gpus and len(slots[e[2]].free) + g >= gpus

    for _round in range(4):
        for g, bucket in singles.items():
            every = sorted(bucket.unordered())  # (the order, without sorting the bucket)
            for gpus in (g + 1, 4, 8):
                fits = fitting_now(gpus, g)
                if _round == 0:  # a plan that reads the first fitting pair only, and stops
                    next(bucket.fitting(gpus, g, slots), None)
                got = list(bucket.fitting(gpus, g, slots))
                assert [e for e in got if fits(e)] == [e for e in every if fits(e)]
                assert got == sorted(got)
                skipped += len(bucket) - len(got)
        # the cycle's starts take free GPUs: some nodes shrink
        with_free = [s for s in slots if s.free]
        assert with_free
        for slot in rng.sample(with_free, min(40, len(with_free))):
            index.take(slot, rng.randint(1, len(slot.free)))
    assert any(len(b) > 64 and b.heap for b in singles.values())  # read deep, never sorted whole
    for g, bucket in singles.items():  # sorted whole after all (a full read), and read again
        assert list(bucket) == sorted(bucket.unordered())
        for gpus in (g + 1, 4, 8):
            fits = fitting_now(gpus, g)
            got = list(bucket.fitting(gpus, g, slots))
            assert [e for e in got if fits(e)] == [e for e in list(bucket) if fits(e)]
    assert skipped > 0  # pairs were skipped for good


def _same_plan(a, b) -> bool:  # noqa: ANN001
    if a is None or b is None:
        return a is b
    return (a.victims, [s.ord for s in a.slots], a.waiting_on) == (b.victims, [s.ord for s in b.slots], b.waiting_on)


@pytest.mark.parametrize("name", list(POLICIES))
def test_plans_with_jobs_already_suspending_find_what_weighing_every_node_finds(monkeypatch, name):
    """A job with jobs suspending for it plans again each cycle until they are done; a plan
    that needs no victim (nodes free now, counting the GPUs being released for it) is taken
    without weighing the victims of every node (one node) or every zone (whole nodes), and on
    one node looked for only among the nodes that had a free GPU when the cycle first asked and
    the job's own (``RunningTable.nodes_with_free``). Every such plan of changing snapshots
    equals the plan that weighs them all (``shortcuts=False``) and the one that looks at every
    node for a free one."""
    seen = {"single": 0, "multi": 0, "differ": 0, "no_victims": 0, "maybe_free": 0}
    real_single, real_multi = pre._fewest_victims_on_a_node, pre.plan_multi

    def single(table, scan, gpus, usable, eligible, pending, shortcuts=True, maybe_free=None):  # noqa: ANN001, ANN202
        got = real_single(table, scan, gpus, usable, eligible, pending, maybe_free=maybe_free)
        want = real_single(table, scan, gpus, usable, eligible, pending, shortcuts=False)
        every = real_single(table, scan, gpus, usable, eligible, pending)  # every node looked at for a free one
        seen["single"] += bool(pending)
        seen["maybe_free"] += maybe_free is not None and len(maybe_free) < len(scan)
        seen["no_victims"] += want is not None and not want.victims
        seen["differ"] += not _same_plan(got, want) or not _same_plan(got, every)
        return got

    def multi(table, index, nodes, gpn, usable, eligible, pending, *a, **k):  # noqa: ANN001, ANN202
        got = real_multi(table, index, nodes, gpn, usable, eligible, pending, *a, **k)
        want = real_multi(table, index, nodes, gpn, usable, eligible, pending, *a, **k, shortcuts=False)
        seen["multi"] += bool(pending)
        seen["no_victims"] += want is not None and not want.victims
        seen["differ"] += not _same_plan(got, want)
        return got

    monkeypatch.setattr(pre, "_fewest_victims_on_a_node", single)
    monkeypatch.setattr(pre, "plan_multi", multi)
    from hai.domain.scheduler import core

    monkeypatch.setattr(core, "plan_multi", multi)
    for seed in (0, 1):
        _cycles(POLICIES[name], seed, cycles=5)
    assert seen["multi"] > 0 and seen["no_victims"] > 0
    # (the capped policy, 3 plans a cycle and a 30-minute minimum runtime, leaves no one-node
    # job waiting on suspensions in these snapshots)
    assert seen["single"] > 0 or name == "fifo-capped"
    assert seen["maybe_free"] > 0 or name == "fifo-capped"
    assert seen["differ"] == 0


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_retry_of_a_level_passes_over_failed_shapes_and_decides_the_same(monkeypatch, name):
    """When reserved nodes are given back during a level, its jobs are offered the capacity
    again; a job with nothing reserved to add whose shape already failed since is passed over
    (it would fail again). Every cycle of changing snapshots decides the same as trying every
    job (``retry_skips_failed_shapes = False``), and jobs were passed over."""
    from decision_hash import canonical

    from hai.domain.scheduler.core import _Cycle

    skipped = []
    real_retry = _Cycle._retry_level

    def retry(self, rank, jobs):  # noqa: ANN001, ANN202
        before = self.retry_skipped
        real_retry(self, rank, jobs)
        skipped.append(self.retry_skipped - before)

    monkeypatch.setattr(_Cycle, "_retry_level", retry)
    pol = POLICIES[name]
    for seed in (0, 1, 2):
        rng = random.Random(seed)
        snap = with_attained_service(build_snapshot(320, 520, 2500, seed), seed)
        now, next_id = NOW, 10_000_000
        for _ in range(5):
            d = schedule(snap, pol, now)
            monkeypatch.setattr(_Cycle, "retry_skips_failed_shapes", False)
            assert canonical(schedule(snap, pol, now)) == canonical(d)
            monkeypatch.setattr(_Cycle, "retry_skips_failed_shapes", True)
            snap, next_id = next_snapshot(snap, d, now, rng.choice((10.0, 600.0)), rng, 100, 20, next_id)
            now += 600.0
    assert sum(skipped) > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_zone_classes_are_every_node_classified_by_the_rule(seed):
    """``RunningTable.zones``: per zone, the nodes holding no indexed job, and every node all of
    whose jobs are past their minimum runtime and not suspending, with its jobs, their lost work,
    the top rank and the top rank of those not past the quantum (-1: none), node by node as the
    rule says (one-job nodes take a shorter path in the build)."""
    from hai.domain.scheduler.core import _Cycle

    snap = build_snapshot(320, 520, 2500, seed)
    cyc = _Cycle(snap, Policy(**FIFO_LEVELS), NOW)
    table, index = cyc.facts.table, cyc.index
    got = table.zones(index)
    start = 0
    singles = 0
    for z, size in enumerate(index.zone_size):
        idle, freeable = [], []
        for o in range(start, start + size):
            hs = table.holders[o]
            if not hs:
                idle.append(o)
            elif all(table.min_ok[i] and not table.pending_mark[i] for i, _g in hs):
                ranks = [table.rank[i] for i, _g in hs]
                young = [table.rank[i] for i, _g in hs if not table.quantum_ok[i]]
                freeable.append((o, tuple(i for i, _g in hs), sum(table.lost[i] for i, _g in hs), max(ranks),
                                 max(young, default=-1)))
                singles += len(hs) == 1
        start += size
        assert got[z].idle == idle and got[z].freeable == freeable
        assert got[z].entry_of == {e[0]: e for e in freeable}
    assert singles > 0 and any(len(e[1]) > 1 for zc in got for e in zc.freeable)


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_free_now_plan_scans_the_idle_nodes_and_the_jobs_own_and_finds_what_every_node_gives(monkeypatch, name):
    """A multi-node job with jobs suspending for it asks every cycle whether some zone has
    enough nodes free now; only the nodes idle when the cycle first asked and those of its own
    suspending jobs are scanned (``RunningTable.idle_nodes``). On every such ask of changing
    snapshots, the candidates of each zone it scanned (nodes free now, the jobs waited for on
    each, nodes per leaf) equal those of a scan of every node of the zone, a zone it did not
    scan has too few nodes free now, and the plan is the plan of the scan of every node: also
    after the cycle's starts took GPUs of nodes that were idle at the first ask. Fewer nodes
    were scanned."""
    seen = {"asks": 0, "plans": 0, "shrunk": 0, "scanned": 0, "zone_nodes": 0}
    real_plan, real_scan, real_idle = pre._free_now_plan, pre._scanned_candidates, vt.RunningTable.idle_nodes

    def free_now_plan(index, table, nodes, gpus_per_node, usable, pend):  # noqa: ANN001, ANN202
        whole, zones, start = [], [], 0
        for size in index.zone_size:
            zone_slots = index.slots[start : start + size]
            cand = real_scan(zone_slots, table, gpus_per_node, usable, None, pend)
            whole.append((cand.free_now, cand.waits_of, cand.potential))
            zones.append([s.ord for s in zone_slots])
            start += size
        # the reference plan: every node of each zone taken as idle, so every node is scanned
        monkeypatch.setattr(vt.RunningTable, "idle_nodes", lambda self, index: zones)
        want = real_plan(index, table, nodes, gpus_per_node, usable, pend)
        monkeypatch.setattr(vt.RunningTable, "idle_nodes", real_idle)
        scanned = {}

        def scan(zone_slots, *a, **k):  # noqa: ANN001, ANN202
            cand = real_scan(zone_slots, *a, **k)
            scanned[zone_slots[0].zone_ix] = (cand.free_now, cand.waits_of, cand.potential)
            seen["scanned"] += len(zone_slots)
            return cand

        monkeypatch.setattr(pre, "_scanned_candidates", scan)
        got = real_plan(index, table, nodes, gpus_per_node, usable, pend)
        monkeypatch.setattr(pre, "_scanned_candidates", real_scan)
        for z, size in enumerate(index.zone_size):
            if size < nodes:
                continue
            seen["zone_nodes"] += size
            if z in scanned:
                assert scanned[z] == whole[z]
            else:
                assert len(whole[z][0]) < nodes
        assert _same_plan(got, want)
        seen["shrunk"] += any(len(index.slots[o].free) < index.slots[o].gpus for z in table.idle_nodes(index) for o in z)
        seen["asks"] += 1
        seen["plans"] += got is not None
        return got

    monkeypatch.setattr(pre, "_free_now_plan", free_now_plan)
    for seed in (0, 1, 2):
        _cycles(POLICIES[name], seed, cycles=5)
    assert seen["asks"] > 0 and seen["plans"] > 0
    assert seen["scanned"] < seen["zone_nodes"]  # the point: not every node
    assert seen["shrunk"] > 0 or name == "fifo-capped"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_one_node_plan_of_a_job_with_jobs_suspending_for_it_looks_for_a_free_node_among_those_with_free_gpus(seed):
    """A one-node plan for a job with jobs suspending for it looks for a node free now (its
    free GPUs and those being released for the job enough) among the nodes that had a free GPU
    when the cycle first asked and the job's own only (``RunningTable.nodes_with_free``), not
    among every node. Asked directly (not after a failed placement, so other nodes with free
    GPUs qualify too), for every job that has jobs suspending for it in changing snapshots, for
    1-8 GPUs, with every node usable and with some not, before and after the cycle's starts
    took GPUs: the plan is the plan that weighs every node (``shortcuts=False``)."""
    from hai.domain.scheduler.core import _Cycle

    rng = random.Random(seed)
    pol = Policy(**FIFO_LEVELS)
    snap = build_snapshot(320, 520, 2500, seed)
    now, next_id = NOW, 10_000_000
    asked = elsewhere = 0
    for _ in range(3):
        d = schedule(snap, pol, now)
        snap, next_id = next_snapshot(snap, d, now, 10.0, rng, 100, 60, next_id)
        now += 10.0
        cyc = _Cycle(snap, pol, now)
        table, index = cyc.facts.table, cyc.index
        eligible = table.eligible_fn(Priority.EXTREME_HIGH.rank, "nobody", False)
        for step in range(3):
            bad = set() if step == 0 else set(rng.sample(range(len(index.slots)), len(index.slots) // 8))
            for target, pending in table.pending_for.items():
                own = {o for i in pending for o in table.nodes_of[i]}
                for gpus in (1, 2, 4, 8):
                    got = pre.plan_single(table, index, gpus, lambda s: s.ord not in bad, eligible, pending,
                                          table.singles(), maxfree=index.max_gpus)
                    want = pre._fewest_victims_on_a_node(table, index.slots, gpus, lambda s: s.ord not in bad, eligible,
                                                         pending, shortcuts=False)
                    assert _same_plan(got, want)
                    asked += 1
                    elsewhere += got is not None and not got.victims and got.slots[0].ord not in own
            # the cycle's starts take free GPUs: some nodes shrink
            with_free = [s for s in index.slots if s.free]
            for slot in rng.sample(with_free, min(30, len(with_free))):
                index.take(slot, rng.randint(1, len(slot.free)))
    assert asked > 0 and elsewhere > 0
