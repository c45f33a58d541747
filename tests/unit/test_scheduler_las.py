"""Least attained service within a priority level (issue 16): service classes by attained
GPU-time, FIFO within a class, suspension only of jobs in a higher class, a quantum that grows
with attained service, promotion of starved jobs, checkpoint-boundary preemption, and explanations
in those terms."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hai.domain.scheduler import SuspendCode, schedule
from scheduler_builders import cluster, job, policy

NOW = 100_000.0
CLASSES = (1000.0, 10_000.0, 100_000.0)  # GPU-seconds
LAS = policy(service_classes_gpu_s=CLASSES, min_runtime_s=900, time_sharing=False)


def one_node():
    return cluster().zone("A", leaves=1, nodes_per_leaf=1)


def test_a_newcomer_suspends_a_job_of_its_priority_with_more_attained_service():
    # the running job has 8 GPUs x 2 h = 57,600 GPU-s (class 2); the newcomer has none (class 0)
    c = one_node().run(job("long").started(NOW - 7200).user("bob"))
    d = schedule(c.queue(job("short").submitted(NOW - 5)).snapshot(), LAS, NOW)
    assert [s.job_id for s in d.suspends] == [c.id_of("long")]
    s = d.suspends[0]
    assert s.code == SuspendCode.TIME_SHARING and s.for_job_id == c.id_of("short")
    assert "16.0 GPU-hours (service class 2, demoted after 2.8 GPU-hours)" in s.reason
    assert "least attained service goes first" in s.reason
    assert "job(s) with more attained service" in d.pending_reasons[c.id_of("short")]


def test_no_suspension_without_service_classes_or_within_a_class_or_before_the_minimum_runtime():
    base = one_node().run(job("long").started(NOW - 7200).user("bob"))
    q = job("short").submitted(NOW - 5)
    # off (the default): FIFO levels, no suspension for a same-priority job before the threshold
    assert schedule(base.queue(q).snapshot(), policy(time_sharing=False), NOW).suspends == []
    # the waiting job is in the same class (it attained 60,000 GPU-s earlier): it waits
    c = one_node().run(job("long").started(NOW - 7200).user("bob"))
    d = schedule(c.queue(job("w").submitted(NOW - 5).attained(60_000)).snapshot(), LAS, NOW)
    assert d.suspends == []
    # the running job is within its minimum runtime (900 s): it keeps its GPUs
    c = one_node().run(job("long").started(NOW - 600).attained(200_000).user("bob"))
    assert schedule(c.queue(job("short").submitted(NOW - 5)).snapshot(), LAS, NOW).suspends == []


def test_queue_by_class_then_fifo_and_the_reason_says_so():
    # two waiting jobs on a full node held by a job within its minimum runtime: the later job with
    # less attained service goes first; the earlier one waits behind it, demoted to class 1
    c = one_node().run(job("r").started(NOW - 60).user("bob"))
    c.queue(job("old").submitted(NOW - 5000).attained(5000), job("new").submitted(NOW - 10))
    d = schedule(c.snapshot(), LAS, NOW)
    reason = d.pending_reasons[c.id_of("old")]
    assert "waits behind 1 job(s) with less attained service" in reason
    assert "(service class 1: demoted after 0.3 GPU-hours of attained service)" in reason
    assert "(service class 0: least attained service)" in d.pending_reasons[c.id_of("new")]
    # when the node frees, the newer job with less attained service starts first
    c2 = one_node().queue(job("old").submitted(NOW - 5000).attained(5000), job("new").submitted(NOW - 10))
    d2 = schedule(c2.snapshot(), LAS, NOW)
    assert [s.job_id for s in d2.starts] == [c2.id_of("new")]


def test_priorities_still_dominate_attained_service():
    c = one_node().queue(job("n").submitted(NOW - 10), job("h").priority("HIGH").submitted(NOW).attained(10**7))
    d = schedule(c.snapshot(), LAS, NOW)
    assert [s.job_id for s in d.starts] == [c.id_of("h")]
    # and a LOW newcomer never suspends a NORMAL job by attained service
    c = one_node().run(job("long").started(NOW - 7200).user("bob"))
    assert schedule(c.queue(job("low").priority("LOW").submitted(NOW)).snapshot(), LAS, NOW).suspends == []


def test_the_quantum_grows_with_attained_service():
    # resumed 1 h ago with 80,000 GPU-s attained over 8 GPUs (10,000 s): with a factor of 0.5 it
    # may be suspended only after 5,000 s of this attempt, then it may
    pol = policy(service_classes_gpu_s=CLASSES, min_runtime_s=900, time_sharing=False, service_quantum_factor=0.5)
    for ran, suspended in ((3600, False), (5100, True)):
        c = one_node().run(job("long").started(NOW - ran).attained(80_000).user("bob"))
        d = schedule(c.queue(job("short").submitted(NOW - 5)).snapshot(), pol, NOW)
        assert bool(d.suspends) is suspended, ran


def test_a_starved_job_is_promoted_to_class_zero():
    # 20,000 GPU-s attained over 8 GPUs = 2,500 s executed; with factor 2 it is promoted after
    # waiting 5,000 s and then goes before a newer class-0 job
    pol = policy(service_classes_gpu_s=CLASSES, time_sharing=False, starvation_factor=2.0)
    for waited, first in ((4000, "new"), (5001, "old")):
        c = one_node().queue(
            job("old").submitted(NOW - 10**5).queued_at(NOW - waited).attained(20_000), job("new").submitted(NOW - 1)
        )
        d = schedule(c.snapshot(), pol, NOW)
        assert [s.job_id for s in d.starts] == [c.id_of(first)], waited


@pytest.mark.parametrize(
    "slack, checkpoint_ago, suspended",
    [
        (0, 200, True),  # off: a victim whenever it is past its minimum runtime
        (60, 30, True),  # within the slack after its last checkpoint: loses at most 30 s of work
        (60, 60, True),  # exactly at the edge
        (60, 200, False),  # too far from its last checkpoint: a victim again at its next one
        (60, None, False),  # no checkpoint yet: counted from its start, 2 h ago
    ],
)
def test_checkpoint_boundary_preemption_under_least_attained_service(slack, checkpoint_ago, suspended):
    pol = policy(service_classes_gpu_s=CLASSES, min_runtime_s=900, time_sharing=False, service_checkpoint_slack_s=slack)
    long = job("long").started(NOW - 7200).user("bob")
    if checkpoint_ago is not None:
        long = long.checkpoint(NOW - checkpoint_ago)
    c = one_node().run(long)
    d = schedule(c.queue(job("short").submitted(NOW - 5)).snapshot(), pol, NOW)
    assert [s.job_id for s in d.suspends] == ([c.id_of("long")] if suspended else [])


def test_the_slack_picks_the_node_whose_job_checkpointed_last():
    # two nodes, each held by a job in class 2; only the one that checkpointed 20 s ago is a victim
    pol = policy(service_classes_gpu_s=CLASSES, min_runtime_s=900, time_sharing=False, service_checkpoint_slack_s=60)
    c = cluster().zone("A", leaves=1, nodes_per_leaf=2)
    c.run(job("far").started(NOW - 7200).checkpoint(NOW - 250).user("bob"))
    c.run(job("near").started(NOW - 7200).checkpoint(NOW - 20).user("bob"))
    d = schedule(c.queue(job("short").submitted(NOW - 5)).snapshot(), pol, NOW)
    assert [s.job_id for s in d.suspends] == [c.id_of("near")]
    assert "about 0.04 GPU-hours since its last checkpoint are lost" in d.suspends[0].reason


def test_every_waiting_job_of_a_class_gets_the_whole_sentence():
    # three jobs of one shape and class wait on a node held within its minimum runtime: each
    # reason names its class (the sentence is made once and shared, suffix included)
    c = one_node().run(job("r").started(NOW - 60).user("bob"))
    c.queue(*(job(f"q{i}").submitted(NOW - 100 + i).attained(5000) for i in range(3)))
    d = schedule(c.snapshot(), LAS, NOW)
    reasons = {d.pending_reasons[c.id_of(f"q{i}")] for i in range(3)}
    assert len(reasons) == 1
    assert reasons.pop().endswith("(service class 1: demoted after 0.3 GPU-hours of attained service)")


@pytest.mark.parametrize(
    "min_class, ran, suspended",
    [
        # resumed with 80,000 GPU-s over 8 GPUs (class 2 of 1,000 / 10,000 / 100,000): factor 0.5
        # earns it 5,000 s of this attempt against least-attained-service suspension
        (0, 1000, False),  # the quantum in every class (the knob's default)
        (2, 1000, False),  # class 2 (88,000 GPU-s now) is at or above the knob's class: kept
        (3, 1000, True),  # below class 3: the minimum runtime only, as without the factor
        (3, 3600, False),  # 108,800 GPU-s now: class 3, within its 5,000 s
        (3, 5100, True),  # class 3 past its grown quantum
    ],
)
def test_the_grown_quantum_only_from_a_service_class_on(min_class, ran, suspended):
    pol = policy(
        service_classes_gpu_s=CLASSES,
        min_runtime_s=900,
        time_sharing=False,
        service_quantum_factor=0.5,
        service_quantum_min_class=min_class,
    )
    c = one_node().run(job("long").started(NOW - ran).attained(80_000).user("bob"))
    d = schedule(c.queue(job("short").submitted(NOW - 5)).snapshot(), pol, NOW)
    assert [s.job_id for s in d.suspends] == ([c.id_of("long")] if suspended else [])


@pytest.mark.parametrize(
    "factor, age, suspended",
    [
        # 80,000 GPU-s attained earlier + 1 h on 8 GPUs now = 108,800 GPU-s: it ran 13,600 s in all;
        # submitted `age` seconds ago, so it waited age - 13,600 s
        (0, 10**6, True),  # off (the default): waiting earns nothing
        (1, 27_200, False),  # waited 13,600 s = 1 x what it ran: kept
        (1, 27_100, True),  # waited a little less than it ran: a victim as before
        (2, 40_800, False),  # waited 2 x what it ran
        (2, 40_000, True),
    ],
)
def test_a_job_that_waited_long_keeps_its_gpus_against_least_attained_service(factor, age, suspended):
    pol = policy(service_classes_gpu_s=CLASSES, min_runtime_s=900, time_sharing=False, service_protect_wait_factor=factor)
    c = one_node().run(job("long").submitted(NOW - age).started(NOW - 3600).attained(80_000).user("bob"))
    d = schedule(c.queue(job("short").submitted(NOW - 5)).snapshot(), pol, NOW)
    assert [s.job_id for s in d.suspends] == ([c.id_of("long")] if suspended else [])


@pytest.mark.parametrize(
    "factor, against_ts, submitted_ago, suspended",
    [
        # bob's job ran 5 h on 8 GPUs (past the 4 h quantum); alice's waited 20 min (past the
        # 15 min threshold): least attained service or, failing that, time-sharing suspends it
        (0, False, 20 * 3600, True),  # nothing kept
        (1, False, 20 * 3600, True),  # waited 15 h >= 1 x 5 h: kept against least attained service only
        (1, True, 20 * 3600, False),  # ... and against time-sharing
        (1, True, 6 * 3600, True),  # waited 1 h < 5 h: not kept
    ],
)
def test_a_kept_job_is_kept_against_time_sharing_too_when_asked(factor, against_ts, submitted_ago, suspended):
    pol = policy(
        service_classes_gpu_s=CLASSES,
        min_runtime_s=900,
        service_protect_wait_factor=factor,
        service_protect_time_sharing=against_ts,
    )
    c = one_node().run(job("long").submitted(NOW - submitted_ago).started(NOW - 5 * 3600).user("bob"))
    d = schedule(c.queue(job("short").submitted(NOW - 1200)).snapshot(), pol, NOW)
    assert [s.job_id for s in d.suspends] == ([c.id_of("long")] if suspended else [])


@pytest.mark.parametrize(
    "knobs, note",
    [
        ({}, None),
        (
            {"service_protect_wait_factor": 1.0},
            "; 1 job(s) with more attained service keep their GPUs (they waited at least 1 x the time they ran)",
        ),
        (
            {"service_quantum_factor": 2.0, "service_quantum_min_class": 2, "service_protect_time_sharing": True},
            "; 1 job(s) with more attained service keep their GPUs (a quantum of 2 x the time their attained"
            " service took in service class 2 or above, against time-sharing too)",
        ),
    ],
)
@pytest.mark.parametrize("cap", [32, 0], ids=["victims-built", "counts-only"])
def test_the_waiting_job_is_told_which_jobs_are_kept_and_why(knobs, note, cap):
    # resumed 1 h ago with 80,000 GPU-s (10,000 s on 8 GPUs), submitted 30 h ago: kept by either knob.
    # cap 0: no preemption is tried, so the kept jobs are counted without building any victim list
    pol = policy(service_classes_gpu_s=CLASSES, min_runtime_s=900, time_sharing=False,
                 max_preemptions_per_cycle=cap, **knobs)
    c = one_node().run(job("long").submitted(NOW - 30 * 3600).started(NOW - 3600).attained(80_000).user("bob"))
    d = schedule(c.queue(job("short").submitted(NOW - 5)).snapshot(), pol, NOW)
    assert len(d.suspends) == (0 if note or not cap else 1)
    reason = d.pending_reasons[c.id_of("short")]
    if note is None:
        assert "keep their GPUs" not in reason
    else:
        assert reason.endswith(note), reason


@pytest.mark.parametrize(
    "knobs",
    [
        {"service_protect_wait_factor": 0.5},
        {"service_quantum_factor": 2.0, "service_quantum_min_class": 2},
        {"service_quantum_factor": 1.0, "service_protect_wait_factor": 1.0},
    ],
)
def test_the_kept_jobs_counted_by_the_victim_facts_are_those_of_the_scan(knobs):
    # The victim facts' full pass counts the jobs a knob keeps (``VictimFacts.knob_kept``), so
    # that the waiting jobs' notes need no pass of their own over the running jobs; the counts
    # must be the scan's (``_las_scan``), job for job: young jobs, multi-node jobs, suspending
    # jobs, jobs of class 0 and jobs of every class kept by either knob or not.
    import random

    from hai.domain.scheduler.core import _Cycle

    rng = random.Random(7)
    pol = policy(service_classes_gpu_s=CLASSES, min_runtime_s=900, **knobs)
    c = cluster().zone("A", leaves=6, nodes_per_leaf=8)
    c.queue(job("waiting").priority("HIGH").submitted(NOW - 5))
    for k in range(4):  # two whole nodes each, past every threshold: never counted
        c.run(job(f"m{k}").gpus(8).on(f"A-l4-n{2 * k}").on(f"A-l4-n{2 * k + 1}")
              .submitted(NOW - 200_000).started(NOW - 40_000).attained(400_000.0))
    for k in range(8):  # one GPU for 5 minutes past a 1-minute minimum: class 0, never counted
        c.run(job(f"s{k}").gpus(1).on(f"A-l5-n{k}").submitted(NOW - 20_000).started(NOW - 300).min_runtime(60.0))
    for k in range(32):
        node = f"A-l{k // 8}-n{k % 8}"
        for half in (0, 1):
            b = (job(f"r{k}-{half}").user(f"u{k % 5}").on(node, tuple(range(4 * half, 4 * half + 4))).gpus(4)
                 .submitted(NOW - rng.choice((1_000, 20_000, 200_000)))
                 .started(NOW - rng.choice((300, 2_000, 9_000, 40_000)))
                 .attained(rng.choice((0.0, 900.0, 5_000.0, 60_000.0, 400_000.0))))
            if rng.random() < 0.1:
                b = b.suspending_for("waiting")
            elif rng.random() < 0.1:
                b = b.min_runtime(rng.choice((60.0, 20_000.0)))
            c.run(b)
    snap = c.snapshot()
    cyc = _Cycle(snap, pol, NOW, None)
    cyc.facts.ensure(full=True)
    counted = cyc.facts.knob_kept
    assert counted is not None and sum(counted) >= 5 and len([k for k in counted if k]) >= 2, counted
    cyc._las_scan(victims=False)
    assert counted == cyc._las_kept
    # and no count where the policy has no such knob
    bare = _Cycle(snap, policy(service_classes_gpu_s=CLASSES, min_runtime_s=900, service_protect_wait_factor=0.0), NOW, None)
    bare.facts.ensure(full=True)
    assert bare.facts.knob_kept is None
