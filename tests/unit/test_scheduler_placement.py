"""Placement rules: zones, fewest leaves, tightest fit, packing, unschedulable nodes, determinism."""

from __future__ import annotations

import operator
import os
import random
import sys
from dataclasses import replace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hai.domain.scheduler import Snapshot, schedule
from hai.domain.scheduler.placement import choose_leaves, min_leaves
from scheduler_builders import cluster, index_facts, job, leaves_of, nodes_of, policy

NOW = 10_000.0


def fill(c, node: str, gpus: int = 8, name: str | None = None):
    """Occupy ``gpus`` GPUs of ``node`` with a HIGH job nobody may preempt."""
    return c.run(job(name or f"busy-{node}-{len(c._running)}").gpus(gpus).priority("EXTREME_HIGH").on(node).started(NOW))


def test_multi_node_job_never_spans_zones():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=4).zone("B", leaves=1, nodes_per_leaf=4)
    fill(c, "A-l0-n0")
    fill(c, "B-l0-n0")
    c.queue(job("big").nodes(4))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.starts == []
    assert d.pending_reasons[c.id_of("big")] == "needs 4 whole nodes in one zone; largest free block is 3 nodes in zone A"


@pytest.mark.parametrize(
    "busy, nodes, want_leaves",
    [
        # leaf A-l0 has 2 idle nodes, A-l1 has 4: a 4-node job fits on one leaf, A-l1
        (["A-l0-n0", "A-l0-n1"], 4, ["A-l1"]),
        # tightest fit: A-l0 has 3 idle, A-l1 has 4; a 3-node job takes the 3-node block
        (["A-l0-n0"], 3, ["A-l0"]),
        # 5 nodes cannot fit on one leaf of 4: two leaves, never three
        ([], 5, ["A-l0", "A-l1"]),
        # a 2-node job goes to the leaf with 2 idle nodes, not the whole idle leaf
        (["A-l1-n0", "A-l1-n1"], 2, ["A-l1"]),
    ],
)
def test_fewest_leaves_then_tightest_fit(busy, nodes, want_leaves):
    c = cluster().zone("A", leaves=2, nodes_per_leaf=4)
    for n in busy:
        fill(c, n)
    c.queue(job("j").nodes(nodes))
    d = schedule(c.snapshot(), policy(), NOW)
    got = nodes_of(d, c.id_of("j"))
    assert len(got) == nodes
    assert leaves_of(got) == want_leaves


def test_tightest_fit_across_zones_keeps_the_big_block_whole():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=8).zone("B", leaves=1, nodes_per_leaf=4)
    c.queue(job("j").nodes(4))
    d = schedule(c.snapshot(), policy(), NOW)
    assert leaves_of(nodes_of(d, c.id_of("j"))) == ["B-l0"]


@pytest.mark.parametrize(
    "counts, nodes, want",
    [
        ([(20, 0), (12, 1), (10, 2)], 22, [(2, 10), (1, 12)]),  # 12 + 10 exactly, the 20 stays whole
        ([(20, 0), (12, 1), (10, 2)], 12, [(1, 12)]),
        ([(20, 0), (12, 1), (10, 2)], 13, [(0, 13)]),
        ([(5, 0), (5, 1), (5, 2)], 11, [(0, 5), (1, 5), (2, 1)]),
        ([(3, 0)], 4, None),
    ],
)
def test_choose_leaves(counts, nodes, want):
    assert choose_leaves(counts, nodes) == want


def test_min_leaves():
    assert min_leaves([4, 4, 2], 5) == 2
    assert min_leaves([4, 4, 2], 11) is None
    assert min_leaves([], 1) is None


def test_small_job_packs_onto_partly_used_node_best_fit():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=4)
    fill(c, "A-l0-n0", gpus=2)  # 6 free
    fill(c, "A-l0-n1", gpus=5)  # 3 free
    c.queue(job("small").gpus(2))
    d = schedule(c.snapshot(), policy(), NOW)
    (start,) = d.starts
    assert start.allocations[0].node == "A-l0-n1"
    assert start.allocations[0].gpus == (5, 6)
    assert "partly used" in start.reason


def test_small_job_breaks_an_idle_node_from_the_most_fragmented_leaf():
    c = cluster().zone("A", leaves=2, nodes_per_leaf=4)
    for n in ["A-l1-n0", "A-l1-n1", "A-l1-n2"]:
        fill(c, n)  # A-l1 keeps one idle node; A-l0 is a whole idle leaf
    c.queue(job("small").gpus(1))
    d = schedule(c.snapshot(), policy(), NOW)
    assert nodes_of(d, c.id_of("small")) == ["A-l1-n3"]


def test_many_small_jobs_fill_one_node_before_the_next():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.queue(*[job(f"s{i}").gpus(1).submitted(i) for i in range(9)])
    d = schedule(c.snapshot(), policy(), NOW)
    placed = [s.allocations[0].node for s in d.starts]
    assert placed == ["A-l0-n0"] * 8 + ["A-l0-n1"]
    gpus = [s.allocations[0].gpus for s in d.starts]
    assert gpus[:8] == [(i,) for i in range(8)]


def test_multi_node_job_takes_only_whole_idle_nodes():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=3)
    fill(c, "A-l0-n0", gpus=1)
    c.queue(job("pair").nodes(2))
    d = schedule(c.snapshot(), policy(), NOW)
    assert sorted(nodes_of(d, c.id_of("pair"))) == ["A-l0-n1", "A-l0-n2"]


@pytest.mark.parametrize("shape", [dict(nodes=1, gpus=8), dict(nodes=1, gpus=1), dict(nodes=2, gpus=8)])
def test_unschedulable_nodes_get_nothing(shape):
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2).unschedulable("A-l0-n0", "A-l0-n1")
    c.queue(job("j").nodes(shape["nodes"]).gpus(shape["gpus"]))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.starts == []
    assert c.id_of("j") in d.pending_reasons


def test_unschedulable_node_is_skipped_for_a_schedulable_one():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2).unschedulable("A-l0-n0")
    c.queue(job("j").gpus(4))
    d = schedule(c.snapshot(), policy(), NOW)
    assert nodes_of(d, c.id_of("j")) == ["A-l0-n1"]


def test_same_snapshot_same_placement_whatever_the_input_order():
    c = cluster().zone("A", leaves=3, nodes_per_leaf=4).zone("B", leaves=2, nodes_per_leaf=4)
    fill(c, "A-l0-n1", gpus=3)
    fill(c, "B-l1-n2")
    c.queue(
        job("a").nodes(3).submitted(1),
        job("b").gpus(2).submitted(2),
        job("c").nodes(5).submitted(3),
        job("d").gpus(5).submitted(4),
        job("e").nodes(2).submitted(5),
    )
    snap = c.snapshot()
    first = schedule(snap, policy(), NOW)
    rng = random.Random(7)
    for _ in range(5):
        nodes = list(snap.nodes)
        queued = list(snap.queued)
        rng.shuffle(nodes)
        rng.shuffle(queued)
        again = schedule(replace(snap, nodes=tuple(nodes), queued=tuple(queued)), policy(), NOW)
        assert again == first


def test_cross_zone_job_spans_zones_only_when_allowed_and_one_at_a_time():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=3).zone("B", leaves=1, nodes_per_leaf=3)
    c.queue(job("wide").nodes(5).cross_zone().submitted(1), job("wide2").nodes(1).gpus(8).submitted(2))
    d = schedule(c.snapshot(), policy(), NOW)
    got = nodes_of(d, c.id_of("wide"))
    assert {n[0] for n in got} == {"A", "B"}
    assert "cross-zone allowed" in d.starts[0].reason

    c2 = cluster().zone("A", leaves=1, nodes_per_leaf=3).zone("B", leaves=1, nodes_per_leaf=3)
    c2.run(job("running-wide").nodes(2).cross_zone().on("A-l0-n0").on("B-l0-n0").priority("EXTREME_HIGH"))
    c2.queue(job("wide").nodes(3).cross_zone())
    d2 = schedule(c2.snapshot(), policy(), NOW)
    # 2 idle in A and 2 in B: would need to span, but another cross-zone job runs
    assert d2.starts == []
    assert "another cross-zone job is running" in d2.pending_reasons[c2.id_of("wide")]


def test_job_without_cross_zone_bigger_than_any_zone_is_told_so():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=3).zone("B", leaves=1, nodes_per_leaf=3)
    c.queue(job("huge").nodes(4))
    d = schedule(c.snapshot(), policy(), NOW)
    assert "largest zone has 3 schedulable nodes" in d.pending_reasons[c.id_of("huge")]


def test_single_node_reason_names_the_most_free():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    fill(c, "A-l0-n0", gpus=6)
    fill(c, "A-l0-n1", gpus=7)
    c.queue(job("j").gpus(4))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.pending_reasons[c.id_of("j")] == "needs 4 GPU(s) on one node; the most free on any available node is 2"


def test_placement_reason_is_recorded_for_every_start():
    c = cluster().zone("A", leaves=2, nodes_per_leaf=4)
    c.queue(job("a").nodes(4).submitted(1), job("b").gpus(1).submitted(2))
    d = schedule(c.snapshot(), policy(), NOW)
    reasons = {s.job_id: s.reason for s in d.starts}
    assert "fewest leaves" in reasons[c.id_of("a")]
    assert "idle node" in reasons[c.id_of("b")]


def test_empty_snapshot():
    d = schedule(Snapshot(nodes=()), policy(), NOW)
    assert d.starts == [] and d.pending_reasons == {}


def test_kept_node_slots_are_built_again_only_where_a_view_changed_or_gpus_were_taken():
    """``KeptSlots``: the next index reuses the last one's slots, except a node whose view is a
    new object and a node the last cycle took GPUs from; what the index says is what a fresh
    build says, a node left out of the index included (its slot was indexed last time). A
    view list of another length or another layout is built in full."""
    from hai.domain.scheduler.model import NodeView
    from hai.domain.scheduler.placement import FreeIndex, KeptSlots

    views = [NodeView(f"n{i:02d}", "z0" if i < 6 else "z1", f"l{i // 3}", 8, tuple(range(8)) if i % 4 else (2, 5))
             for i in range(12)]
    kept = KeptSlots()
    a = FreeIndex(views, kept)
    a.fill({})
    assert (kept.built, kept.rebuilt) == (1, 12)
    a.take(a.by_name["n03"], 2)
    a.take(a.by_name["n09"], 8)
    before = list(a.slots)  # (the kept list itself is updated in place)
    v2 = list(views)
    v2[7] = replace(views[7], free_gpus=(0, 1))
    v2[9] = replace(views[9], free_gpus=(1, 3, 4))  # given back after the take: the view wins
    b = FreeIndex(v2, kept)
    assert (kept.built, kept.rebuilt) == (1, 3)  # n03 taken from, n07 and n09 new views
    assert [s.name for s, old in zip(b.slots, before) if s is not old] == ["n03", "n07", "n09"]
    b.fill({"n01": 1, "n07": 1})  # n01 was indexed in the last cycle
    fresh = FreeIndex(v2)
    fresh.fill({"n01": 1, "n07": 1})
    assert index_facts(b) == index_facts(fresh)
    assert b.by_name["n03"].free == list(range(8)) and b.by_name["n07"].free == [0, 1]
    before = list(b.slots)
    c = FreeIndex(v2, kept)  # nothing taken, no view changed: every slot as it was
    assert kept.rebuilt == 0 and all(map(operator.is_, c.slots, before))
    c.fill({})
    fresh = FreeIndex(v2)
    fresh.fill({})
    assert index_facts(c) == index_facts(fresh)
    FreeIndex([replace(v) for v in v2], kept)  # every view a new object: built in full, not slot by slot
    assert kept.built == 2
    FreeIndex(v2[:-1], kept)  # a node fewer (drained): built in full
    assert kept.built == 3
    moved = v2[:-1]
    moved[2] = replace(moved[2], leaf="l3")  # another layout: built in full
    d = FreeIndex(moved, kept)
    assert kept.built == 4
    d.fill({})
    fresh = FreeIndex(moved)
    fresh.fill({})
    assert index_facts(d) == index_facts(fresh)
