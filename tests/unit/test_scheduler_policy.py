"""Priorities, FIFO, quotas, demotion, reservations, gang, explanations, purity."""

from __future__ import annotations

import ast
import copy
import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hai.domain.jobs import Priority
from hai.domain.scheduler import Demote, schedule
from scheduler_builders import cluster, job, nodes_of, policy

NOW = 100_000.0
MIN = 60.0


def one_node():
    return cluster().zone("A", leaves=1, nodes_per_leaf=1)


def started_ids(d):
    return [s.job_id for s in d.starts]


# -- priorities and FIFO -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "queue, expected_first",
    [
        # higher priority first, even if submitted later
        ([job("n").submitted(1), job("h").priority("HIGH").submitted(50)], "h"),
        ([job("l").priority("LOW").submitted(1), job("n").submitted(9)], "n"),
        ([job("a").priority("ABOVE_NORMAL").submitted(9), job("n").submitted(1)], "a"),
        ([job("x").priority("EXTREME_HIGH").submitted(9), job("v").priority("VERY_HIGH").submitted(1)], "x"),
        # FIFO by first submission within a priority, whatever the (re-)queue time
        ([job("late").submitted(20).queued_at(20), job("early").submitted(10).queued_at(NOW - 1)], "early"),
        # equal submission: lower id first
        ([job("first").submitted(5), job("second").submitted(5)], "first"),
    ],
)
def test_priority_then_fifo_by_first_submission(queue, expected_first):
    c = one_node().queue(*queue)
    d = schedule(c.snapshot(), policy(time_sharing=False), NOW)
    assert started_ids(d) == [c.id_of(expected_first)]
    assert len(d.pending_reasons) == len(queue) - 1


def test_smaller_job_backfills_when_the_head_does_not_fit():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("r").gpus(8).priority("EXTREME_HIGH").on("A-l0-n0").started(NOW))
    c.queue(job("big").nodes(2).submitted(1), job("small").gpus(4).submitted(2))
    d = schedule(c.snapshot(), policy(), NOW)
    assert started_ids(d) == [c.id_of("small")]
    assert c.id_of("big") in d.pending_reasons


def test_every_queued_job_that_does_not_start_has_a_reason():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.queue(*[job(f"j{i}").gpus(3).submitted(i) for i in range(10)])
    d = schedule(c.snapshot(), policy(), NOW)
    started = set(started_ids(d))
    assert len(started) == 4  # two 3-GPU jobs on each 8-GPU node
    assert set(d.pending_reasons) == {c.id_of(f"j{i}") for i in range(10)} - started
    assert all(r.strip() for r in d.pending_reasons.values())


def test_gang_all_ranks_start_together_or_not_at_all():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=4)
    c.run(job("r").gpus(1).priority("EXTREME_HIGH").on("A-l0-n0").started(NOW))
    c.queue(job("gang").nodes(4))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.starts == []
    c2 = cluster().zone("A", leaves=1, nodes_per_leaf=4).queue(job("gang").nodes(4))
    d2 = schedule(c2.snapshot(), policy(), NOW)
    (start,) = d2.starts
    assert len(start.allocations) == 4 and all(len(a.gpus) == 8 for a in start.allocations)


# -- quotas ----------------------------------------------------------------------------------------


def test_group_quota_blocks_with_a_reason_a_person_understands():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=16)
    for i in range(8):
        c.run(job(f"v{i}").priority("HIGH").group("vision").user(f"u{i}").started(NOW))
    c.quota("vision", "HIGH", 64)
    c.queue(job("more").priority("HIGH").group("vision").gpus(8))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.starts == []
    assert d.pending_reasons[c.id_of("more")] == "group vision at HIGH uses 64 of 64 GPUs; this job needs 8"


@pytest.mark.parametrize(
    "quotas, queue, expected",
    [
        # group quota 8 at NORMAL: only one of two 8-GPU jobs in the same cycle
        ([("g", "NORMAL", 8, None)], [("a", "NORMAL", "u1"), ("b", "NORMAL", "u2")], ["a"]),
        # the quota is per priority: a HIGH job is not limited by the NORMAL quota
        ([("g", "NORMAL", 8, None)], [("a", "NORMAL", "u1"), ("h", "HIGH", "u2")], ["h", "a"]),
        # per-user quota inside the group
        ([("g", "NORMAL", 8, "u1")], [("a", "NORMAL", "u1"), ("b", "NORMAL", "u1"), ("c", "NORMAL", "u2")], ["a", "c"]),
        # no quota row: no cap
        ([], [("a", "NORMAL", "u1"), ("b", "NORMAL", "u1")], ["a", "b"]),
        # a quota row of another group does not apply
        ([("other", "NORMAL", 0, None)], [("a", "NORMAL", "u1")], ["a"]),
    ],
)
def test_quotas_are_never_exceeded(quotas, queue, expected):
    c = cluster().zone("A", leaves=1, nodes_per_leaf=4)
    for g, p, n, u in quotas:
        c.quota(g, p, n, user=u)
    c.queue(*[job(name).priority(p).user(u).group("g").submitted(i) for i, (name, p, u) in enumerate(queue)])
    d = schedule(c.snapshot(), policy(), NOW)
    assert started_ids(d) == [c.id_of(n) for n in expected]


def test_a_quota_filled_during_the_cycle_blocks_later_jobs_beside_a_generous_one():
    # the cycle decides most jobs without a quota lookup while every cap has room for them;
    # once a start fills group "tight", its later jobs must get the quota's reason, also on
    # the fast path (their shape has already failed to place), while group "big" goes on
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.quota("big", "NORMAL", 1000).quota("tight", "NORMAL", 8)
    c.queue(
        job("t1").group("tight").user("ann").submitted(0),
        job("b1").group("big").user("bob").submitted(1),
        job("b2").group("big").user("bob").submitted(2),
        job("t2").group("tight").user("ann").submitted(3),
        job("t3").group("tight").user("cat").gpus(1).submitted(4),
    )
    d = schedule(c.snapshot(), policy(), NOW)
    assert started_ids(d) == [c.id_of("t1"), c.id_of("b1")]
    assert d.pending_reasons[c.id_of("t2")] == "group tight at NORMAL uses 8 of 8 GPUs; this job needs 8"
    assert d.pending_reasons[c.id_of("t3")] == "group tight at NORMAL uses 8 of 8 GPUs; this job needs 1"
    assert d.pending_reasons[c.id_of("b2")].startswith("needs 8 GPU(s) on one node")


def test_quota_answers_are_shared_by_a_groups_users_unless_some_user_has_a_cap():
    # the cycle asks the book once per (group, priority, GPUs), not once per user too, while
    # no user has a cap of their own: the answer cannot depend on the user then
    from hai.domain.scheduler.model import QueuedJob, Quota
    from hai.domain.scheduler.quota import QuotaBook

    ann, bob = (QueuedJob(i, u, "g", Priority.NORMAL, 1, 8, 0.0, 0.0) for i, u in ((1, "ann"), (2, "bob")))
    book = QuotaBook([Quota("g", Priority.NORMAL, 8)])
    book.charge("g", Priority.NORMAL.rank, "cat", 8)
    assert book.blocked(ann) == book.blocked(bob) == "group g at NORMAL uses 8 of 8 GPUs; this job needs 8"
    assert book.memo_key(ann) == book.memo_key(bob) and len(book.memo) == 1
    # a cap of ann's own: her answer is hers, bob's is asked for him
    book = QuotaBook([Quota("g", Priority.NORMAL, 16), Quota("g", Priority.NORMAL, 8, user="ann")])
    book.charge("g", Priority.NORMAL.rank, "ann", 8)
    assert book.blocked(ann) == "user ann in group g at NORMAL uses 8 of 8 GPUs; this job needs 8"
    assert book.blocked(bob) is None
    assert book.memo_key(ann) != book.memo_key(bob) and len(book.memo) == 2


def test_job_larger_than_its_quota_says_so():
    c = one_node().quota("g", "NORMAL", 4).queue(job("a").group("g").gpus(8))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.pending_reasons[c.id_of("a")] == "needs 8 GPUs but group g's quota at NORMAL is 4 GPUs"


def test_user_quota_reason():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("r").user("ann").group("nlp").gpus(8).started(NOW))
    c.quota("nlp", "NORMAL", 8, user="ann")
    c.queue(job("q").user("ann").group("nlp").gpus(2))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.pending_reasons[c.id_of("q")] == "user ann in group nlp at NORMAL uses 8 of 8 GPUs; this job needs 2"


def test_suspending_jobs_still_count_against_the_quota():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("s").group("g").state("suspending").on("A-l0-n0").started(0))
    c.quota("g", "NORMAL", 8).queue(job("q").group("g"))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.starts == []
    assert "uses 8 of 8" in d.pending_reasons[c.id_of("q")]


# -- demotion ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ran_min, demoted", [(29, False), (30, True), (120, True)])
def test_above_normal_is_demoted_after_demote_after(ran_min, demoted):
    c = one_node().run(job("a").priority("ABOVE_NORMAL").started(NOW - ran_min * MIN))
    d = schedule(c.snapshot(), policy(demote_after_s=30 * MIN), NOW)
    if demoted:
        assert d.demotions == [Demote(c.id_of("a"), Priority.NORMAL, d.demotions[0].reason)]
        assert "demoted to NORMAL after 30 min" in d.demotions[0].reason
    else:
        assert d.demotions == []


@pytest.mark.parametrize("prio", ["NORMAL", "HIGH", "LOW"])
def test_only_above_normal_is_demoted(prio):
    c = one_node().run(job("a").priority(prio).started(0))
    assert schedule(c.snapshot(), policy(), NOW).demotions == []


def test_a_demoted_job_counts_as_normal_for_preemption_and_quota():
    c = one_node().run(job("a").priority("ABOVE_NORMAL").user("ann").group("g").started(NOW - 40 * MIN))
    c.queue(job("b").priority("ABOVE_NORMAL").user("bob").group("g"))
    c.quota("g", "ABOVE_NORMAL", 8)
    d = schedule(c.snapshot(), policy(), NOW)
    # demoted to NORMAL: no longer uses the ABOVE_NORMAL quota, and is now preemptible by b
    assert [x.job_id for x in d.demotions] == [c.id_of("a")]
    assert [s.job_id for s in d.suspends] == [c.id_of("a")]
    assert d.suspends[0].for_job_id == c.id_of("b")


# -- reservations ----------------------------------------------------------------------------------------


def test_reserved_nodes_are_not_taken_by_others():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("victim").priority("LOW").state("suspending").on("A-l0-n0").suspending_for("waiter"))
    c.queue(
        job("waiter").nodes(2).priority("HIGH").reserved("A-l0-n0", "A-l0-n1").submitted(5),
        job("sneaky").gpus(1).priority("NORMAL").submitted(1),
    )
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.starts == []  # A-l0-n1 is idle but reserved for the HIGH job
    assert d.reservations == {c.id_of("waiter"): ("A-l0-n0", "A-l0-n1")}
    assert d.pending_reasons[c.id_of("waiter")].startswith("waiting for 1 job to reach a checkpoint")
    assert "reserved for other jobs" in d.pending_reasons[c.id_of("sneaky")]
    assert d.suspends == []  # the suspending victim is not suspended again


def test_a_higher_priority_job_may_use_a_lower_owners_reserved_node():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("victim").priority("LOW").state("suspending").on("A-l0-n0").suspending_for("waiter"))
    c.queue(
        job("waiter").nodes(2).priority("NORMAL").reserved("A-l0-n0", "A-l0-n1").submitted(5),
        job("vip").gpus(8).priority("EXTREME_HIGH").submitted(9),
    )
    d = schedule(c.snapshot(), policy(), NOW)
    assert nodes_of(d, c.id_of("vip")) == ["A-l0-n1"]
    # the owner re-plans in its turn: nothing left to preempt, so it keeps waiting without a reservation
    assert c.id_of("waiter") not in d.reservations
    assert c.id_of("waiter") in d.pending_reasons


def test_owner_starts_on_its_reserved_nodes_once_free_and_the_reservation_ends():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.queue(
        job("other").gpus(8).priority("HIGH").submitted(1),
        job("owner").gpus(8).priority("HIGH").reserved("A-l0-n1").submitted(2),
    )
    d = schedule(c.snapshot(), policy(), NOW)
    assert nodes_of(d, c.id_of("owner")) == ["A-l0-n1"]
    assert nodes_of(d, c.id_of("other")) == ["A-l0-n0"]
    assert d.reservations == {}


def test_capacity_a_reservation_gives_back_mid_cycle_goes_to_earlier_jobs_in_the_same_cycle():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("busy").gpus(7).priority("EXTREME_HIGH").on("A-l0-n1").started(NOW))
    c.queue(
        job("early").gpus(8).submitted(1),  # A-l0-n0 is reserved for "late" when its turn comes
        job("late").gpus(1).reserved("A-l0-n0").submitted(2),  # best fit: the partly used A-l0-n1
    )
    d = schedule(c.snapshot(), policy(), NOW)
    assert nodes_of(d, c.id_of("late")) == ["A-l0-n1"]
    assert nodes_of(d, c.id_of("early")) == ["A-l0-n0"]  # the node "late" no longer needed
    assert d.reservations == {} and d.pending_reasons == {}


def test_quota_holds_when_capacity_comes_back_late_in_the_cycle():
    """Found by the property test: two jobs of one group pass the quota check in their turn,
    capacity they can use comes back later in the cycle; only one of them may take it."""
    c = cluster().zone("A", leaves=1, nodes_per_leaf=3)
    c.run(job("busy").priority("EXTREME_HIGH").on("A-l0-n0").started(NOW))
    c.quota("g", "NORMAL", 8)
    c.usage("ann", 1.0).usage("bob", 2.0)
    c.queue(
        job("w1").group("g").user("ann").submitted(1).queued_at(NOW - 3600),
        job("w2").group("g").user("bob").gpus(4).submitted(2).queued_at(NOW - 3600),
        job("r").group("h").user("cat").gpus(1).reserved("A-l0-n1", "A-l0-n2").submitted(3),
    )
    d = schedule(c.snapshot(), policy(), NOW)
    assert nodes_of(d, c.id_of("r")) == ["A-l0-n1"]
    assert nodes_of(d, c.id_of("w1")) == ["A-l0-n2"]  # the node "r" gave back
    assert c.id_of("w2") not in [s.job_id for s in d.starts]
    assert d.pending_reasons[c.id_of("w2")] == "group g at NORMAL uses 8 of 8 GPUs; this job needs 4"


def test_reservation_of_a_quota_blocked_job_is_dropped():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.quota("g", "HIGH", 0)
    c.queue(job("owner").priority("HIGH").group("g").reserved("A-l0-n0"), job("next").priority("LOW").submitted(3))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.reservations == {}
    assert started_ids(d) == [c.id_of("next")]


# -- purity ----------------------------------------------------------------------------------------


def test_planning_leaves_the_snapshot_unchanged():
    c = cluster().zone("A", leaves=2, nodes_per_leaf=2).zone("B", leaves=1, nodes_per_leaf=2)
    c.run(job("low1").priority("LOW").user("x").started(0).on("A-l0-n0"))
    c.run(job("low2").priority("LOW").user("y").gpus(4).started(0).on("A-l0-n1"))
    c.run(job("n1").user("z").started(0).checkpoint(10).on("A-l1-n0"))
    c.run(job("sus").priority("LOW").state("suspending").on("B-l0-n0").suspending_for("h2"))
    c.run(job("a").priority("ABOVE_NORMAL").started(0).on("A-l1-n1"))
    c.queue(
        job("h1").nodes(2).priority("HIGH").submitted(1),
        job("h2").priority("HIGH").reserved("B-l0-n0").submitted(2),
        job("ts").user("w").submitted(3),
        job("small").gpus(2).submitted(4),
    )
    c.quota("research", "HIGH", 64).usage("w", 5.0)
    snap = c.snapshot()
    before = copy.deepcopy(snap)
    d1 = schedule(snap, policy(), NOW)
    assert snap == before
    assert d1.suspends and d1.reservations  # it did plan preemptions
    d2 = schedule(snap, policy(), NOW)
    assert d1 == d2


_ALLOWED_TOP = {
    "__future__", "array", "bisect", "gc", "collections", "contextlib", "dataclasses", "datetime", "enum", "functools", "heapq",
    "itertools", "math", "operator", "typing", "csv", "io", "re", "pydantic", "hai",
}
_FORBIDDEN = ("sqlalchemy", "redis", "celery", "httpx", "fastapi", "kubernetes")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("enabled", [True, False])
def test_a_cycle_leaves_the_garbage_collector_as_it_found_it(enabled):
    # schedule() pauses the cyclic collector while it runs; the caller's setting comes back,
    # also when the cycle raises
    c = one_node().queue(job("a").gpus(1))
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        schedule(c.snapshot(), policy(), NOW)
        assert gc.isenabled() is enabled
        with pytest.raises(AttributeError):
            schedule(None, policy(), NOW)  # type: ignore[arg-type]
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_scheduler_and_topology_are_pure_domain_code():
    root = Path(__file__).resolve().parents[2] / "backend" / "hai" / "domain"
    files = sorted((root / "scheduler").glob("*.py")) + [root / "topology.py"]
    assert len(files) >= 5
    for f in files:
        for name in _imports(f):
            top = name.split(".")[0]
            assert top not in _FORBIDDEN, f"{f.name} imports {name}"
            assert top in _ALLOWED_TOP, f"{f.name} imports {name}"
            if top == "hai":
                assert name.startswith("hai.domain"), f"{f.name} imports {name} (domain may only import domain)"
