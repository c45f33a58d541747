"""Preemption at checkpoint boundaries, victim choice, time-sharing, reservations over cycles."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hai.domain.jobs import JobState
from hai.domain.scheduler import NodeView, schedule
from scheduler_builders import cluster, job, nodes_of, policy

MIN = 60.0
HOUR = 3600.0
NOW = 100 * HOUR


def victims(d):
    return sorted(s.job_id for s in d.suspends)


# -- preemption by priority ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "victim_prio, ran_min, waiter_prio, same_user, expect_suspend",
    [
        ("LOW", 20, "HIGH", False, True),
        ("LOW", 20, "NORMAL", False, True),
        ("LOW", 20, "NORMAL", True, True),  # another priority: the same user is fine
        ("LOW", 10, "HIGH", False, False),  # not before its minimum runtime (15 min)
        ("NORMAL", 20, "NORMAL", False, False),  # same priority: not by priority (time-sharing only)
        ("HIGH", 20, "NORMAL", False, False),  # never a higher priority
        ("VERY_HIGH", 500, "EXTREME_HIGH", False, True),
    ],
)
def test_preemption_rules(victim_prio, ran_min, waiter_prio, same_user, expect_suspend):
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("v").priority(victim_prio).user("ann").started(NOW - ran_min * MIN))
    c.queue(job("w").priority(waiter_prio).user("ann" if same_user else "bob").queued_at(NOW - 1 * MIN))
    d = schedule(c.snapshot(), policy(), NOW)
    if expect_suspend:
        assert victims(d) == [c.id_of("v")]
        assert d.suspends[0].for_job_id == c.id_of("w")
        assert d.reservations == {c.id_of("w"): ("A-l0-n0",)}
        assert d.pending_reasons[c.id_of("w")].startswith("waiting for 1 job to reach a checkpoint")
        assert "next checkpoint" in d.suspends[0].reason
    else:
        assert d.suspends == [] and d.reservations == {}


def test_min_runtime_is_explained():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("v").priority("LOW").started(NOW - 5 * MIN))
    c.queue(job("w").priority("HIGH").queued_at(NOW))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.pending_reasons[c.id_of("w")].endswith(
        "; 1 lower-priority job could make room but has run less than the 15 min minimum"
    )


def test_per_job_minimum_runtime_overrides_the_policy():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("long-min").priority("LOW").started(NOW - 30 * MIN).min_runtime(HOUR).on("A-l0-n0"))
    c.run(job("default").priority("LOW").started(NOW - 30 * MIN).on("A-l0-n1"))
    c.queue(job("w").priority("HIGH"))
    d = schedule(c.snapshot(), policy(), NOW)
    assert victims(d) == [c.id_of("default")]


def test_fewest_victims_then_least_lost_work():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=3)
    # node 0: one 8-GPU LOW job that checkpointed long ago (much lost work)
    c.run(job("big").priority("LOW").started(NOW - 5 * HOUR).checkpoint(NOW - HOUR).on("A-l0-n0"))
    # node 1: two 4-GPU LOW jobs that both just checkpointed (little lost work, but two victims)
    c.run(job("h1").priority("LOW").gpus(4).started(NOW - 5 * HOUR).checkpoint(NOW - 10).on("A-l0-n1"))
    c.run(job("h2").priority("LOW").gpus(4).started(NOW - 5 * HOUR).checkpoint(NOW - 10).on("A-l0-n1"))
    # node 2: one 8-GPU LOW job that checkpointed recently: one victim, least lost
    c.run(job("fresh").priority("LOW").started(NOW - 5 * HOUR).checkpoint(NOW - 60).on("A-l0-n2"))
    c.queue(job("w").priority("HIGH"))
    d = schedule(c.snapshot(), policy(), NOW)
    assert victims(d) == [c.id_of("fresh")]
    assert d.reservations[c.id_of("w")] == ("A-l0-n2",)


def test_victims_on_one_node_cover_the_need_with_the_fewest_jobs():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("a").priority("LOW").gpus(2).started(0).checkpoint(NOW - 10).on("A-l0-n0"))
    c.run(job("b").priority("LOW").gpus(2).started(0).checkpoint(NOW - 20).on("A-l0-n0"))
    c.run(job("c").priority("LOW").gpus(4).started(0).checkpoint(NOW - 1000).on("A-l0-n0"))
    c.queue(job("w").priority("HIGH").gpus(4))
    d = schedule(c.snapshot(), policy(), NOW)
    # c alone frees 4 GPUs (one victim) although a+b lose less work: fewest victims first
    assert victims(d) == [c.id_of("c")]


def test_multi_node_victim_preferred_when_it_frees_the_placement_alone():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2).zone("B", leaves=1, nodes_per_leaf=2)
    c.run(job("a0").priority("LOW").user("x").started(0).checkpoint(NOW - 5).on("A-l0-n0"))
    c.run(job("a1").priority("LOW").user("y").started(0).checkpoint(NOW - 5).on("A-l0-n1"))
    c.run(job("pair").priority("LOW").user("z").nodes(2).started(0).checkpoint(NOW - 600).on("B-l0-n0").on("B-l0-n1"))
    c.queue(job("w").priority("HIGH").nodes(2))
    d = schedule(c.snapshot(), policy(), NOW)
    assert victims(d) == [c.id_of("pair")]
    assert d.reservations[c.id_of("w")] == ("B-l0-n0", "B-l0-n1")


def test_multi_node_preemption_stays_in_one_zone_and_uses_idle_nodes_first():
    c = cluster().zone("A", leaves=2, nodes_per_leaf=2).zone("B", leaves=1, nodes_per_leaf=2)
    # zone A: 3 idle nodes on two leaves, one LOW job; zone B: two LOW jobs
    c.run(job("a").priority("LOW").started(0).on("A-l1-n1"))
    c.run(job("b0").priority("LOW").started(0).on("B-l0-n0"))
    c.run(job("b1").priority("LOW").started(0).on("B-l0-n1"))
    c.queue(job("w").priority("HIGH").nodes(4))
    d = schedule(c.snapshot(), policy(), NOW)
    assert victims(d) == [c.id_of("a")]
    assert d.reservations[c.id_of("w")] == ("A-l0-n0", "A-l0-n1", "A-l1-n0", "A-l1-n1")


def test_jobs_of_higher_priority_pin_their_nodes():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("low").priority("LOW").gpus(4).started(0).on("A-l0-n0"))
    c.run(job("vip").priority("EXTREME_HIGH").gpus(4).started(0).on("A-l0-n0"))
    c.queue(job("w").priority("HIGH").gpus(8))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.suspends == []


def test_preemption_can_be_switched_off():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("v").priority("LOW").started(0))
    c.queue(job("w").priority("HIGH"))
    assert schedule(c.snapshot(), policy(preemption=False), NOW).suspends == []


def test_at_most_max_preemptions_per_cycle():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=3)
    for i in range(3):
        c.run(job(f"v{i}").priority("LOW").started(0).on(f"A-l0-n{i}"))
    c.queue(*[job(f"w{i}").priority("HIGH").submitted(i) for i in range(3)])
    d = schedule(c.snapshot(), policy(max_preemptions_per_cycle=2), NOW)
    assert len(d.suspends) == 2
    assert sorted(d.reservations) == [c.id_of("w0"), c.id_of("w1")]
    assert "the next cycle continues" in d.pending_reasons[c.id_of("w2")]


def test_each_victim_is_chosen_once():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("v").priority("LOW").started(0).on("A-l0-n0"))
    c.run(job("keep").priority("HIGH").started(0).on("A-l0-n1"))
    c.queue(job("w1").priority("HIGH").submitted(1), job("w2").priority("HIGH").submitted(2))
    d = schedule(c.snapshot(), policy(), NOW)
    assert victims(d) == [c.id_of("v")]
    assert d.suspends[0].for_job_id == c.id_of("w1")


def test_a_waiting_job_does_not_take_new_victims_while_its_own_are_suspending():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("going").priority("LOW").state("suspending").suspending_for("w").on("A-l0-n0"))
    c.run(job("other").priority("LOW").started(0).on("A-l0-n1"))
    c.queue(job("w").priority("HIGH").reserved("A-l0-n0"))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.suspends == []
    assert d.reservations == {c.id_of("w"): ("A-l0-n0",)}
    assert d.pending_reasons[c.id_of("w")].startswith("waiting for 1 job to reach a checkpoint")


def test_suspending_jobs_are_never_suspended_again():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("going").priority("LOW").state("suspending").on("A-l0-n0"))
    c.queue(job("w").priority("HIGH"))
    d = schedule(c.snapshot(), policy(), NOW)
    assert d.suspends == []
    assert c.id_of("w") in d.pending_reasons


def test_live_story_high_job_on_full_cluster_suspends_the_right_low_job_and_starts_on_its_nodes():
    """Three cycles, with the service's part (state changes) played by the test."""
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("low-old").priority("LOW").user("ann").started(NOW - 2 * HOUR).checkpoint(NOW - 50 * MIN).on("A-l0-n0"))
    c.run(job("low-new").priority("LOW").user("bob").started(NOW - 2 * HOUR).checkpoint(NOW - 2 * MIN).on("A-l0-n1"))
    c.queue(job("high").priority("HIGH").user("cat").submitted(NOW).queued_at(NOW))
    c.queue(job("low-q").priority("LOW").user("dan").gpus(1).submitted(0))
    snap = c.snapshot()
    high, low_new = c.id_of("high"), c.id_of("low-new")

    # cycle 1: suspend the LOW job that loses least (checkpointed 2 min ago), reserve its node
    d1 = schedule(snap, policy(), NOW)
    assert victims(d1) == [low_new]
    assert d1.reservations == {high: ("A-l0-n1",)}

    # service: the victim is SUSPENDING for `high`; the reservation is stored on the queued job
    running = tuple(
        replace(r, state=JobState.SUSPENDING, suspend_requested_for=high) if r.id == low_new else r for r in snap.running
    )
    queued = tuple(replace(q, reserved_nodes=d1.reservations.get(q.id, ())) for q in snap.queued)
    snap2 = replace(snap, running=running, queued=queued)
    d2 = schedule(snap2, policy(), NOW + 30)
    assert d2.suspends == [] and d2.starts == []
    assert d2.reservations == {high: ("A-l0-n1",)}

    # service: the victim checkpointed and released its GPUs; it is queued again
    nodes = tuple(replace(n, free_gpus=tuple(range(8))) if n.name == "A-l0-n1" else n for n in snap2.nodes)
    running3 = tuple(r for r in snap2.running if r.id != low_new)
    snap3 = replace(snap2, nodes=nodes, running=running3)
    d3 = schedule(snap3, policy(), NOW + 60)
    assert nodes_of(d3, high) == ["A-l0-n1"]
    assert [s.job_id for s in d3.starts] == [high]  # low-q (earlier, LOW) did not take the reserved GPUs
    assert d3.reservations == {}
    assert isinstance(snap3.nodes[0], NodeView)


# -- time-sharing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ran_h, waited_min, same_user, expect",
    [
        (5, 20, False, True),
        (3, 20, False, False),  # has not run its 4 h quantum
        (5, 10, False, False),  # has not waited past the 15 min threshold
        (5, 20, True, False),  # never the same user at the same priority
    ],
)
def test_time_sharing_rules(ran_h, waited_min, same_user, expect):
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("long").user("ann").started(NOW - ran_h * HOUR))
    c.queue(job("w").user("ann" if same_user else "bob").submitted(NOW - 9 * HOUR).queued_at(NOW - waited_min * MIN))
    d = schedule(c.snapshot(), policy(), NOW)
    if expect:
        assert victims(d) == [c.id_of("long")]
        assert d.suspends[0].reason.startswith("time-sharing: it ran 5 h, past the 4 h quantum at NORMAL")
        assert d.reservations == {c.id_of("w"): ("A-l0-n0",)}
    else:
        assert d.suspends == []


def test_time_sharing_can_be_switched_off():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("long").user("ann").started(NOW - 9 * HOUR))
    c.queue(job("w").user("bob").queued_at(NOW - HOUR))
    assert schedule(c.snapshot(), policy(time_sharing=False), NOW).suspends == []


def test_time_sharing_serves_the_user_with_the_least_recent_usage_first():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("long").user("ann").started(NOW - 9 * HOUR))
    c.queue(
        job("heavy").user("hank").submitted(1).queued_at(NOW - HOUR),
        job("light").user("lisa").submitted(2).queued_at(NOW - HOUR),
    )
    c.usage("hank", 1e6).usage("lisa", 10.0)
    d = schedule(c.snapshot(), policy(), NOW)
    assert [s.for_job_id for s in d.suspends] == [c.id_of("light")]
    assert "time-sharing: no job of another user at NORMAL" in d.pending_reasons[c.id_of("heavy")]


def test_time_sharing_durations_come_from_the_policy():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("long").user("ann").started(NOW - 2 * HOUR))
    c.queue(job("w").user("bob").queued_at(NOW - 3 * MIN))
    assert schedule(c.snapshot(), policy(), NOW).suspends == []
    d = schedule(c.snapshot(), policy(quantum_s=HOUR, wait_threshold_s=2 * MIN), NOW)
    assert victims(d) == [c.id_of("long")]


def test_lower_priority_victims_before_time_sharing_ones():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("same").user("ann").started(NOW - 9 * HOUR).checkpoint(NOW - 1).on("A-l0-n0"))
    c.run(job("low").priority("LOW").user("ann").started(NOW - HOUR).checkpoint(NOW - 3000).on("A-l0-n1"))
    c.queue(job("w").user("bob").queued_at(NOW - HOUR))
    d = schedule(c.snapshot(), policy(), NOW)
    assert victims(d) == [c.id_of("low")]
