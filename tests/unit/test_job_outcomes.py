"""What agents' reports mean for a job (hai.domain.outcomes): the named rules, without a database."""

from __future__ import annotations

import pytest

from hai.domain.jobs import JobState, allowed_targets
from hai.domain.outcomes import (
    RULES,
    AttemptReports,
    NodeReport,
    Outcome,
    RankReport,
    Verdict,
    first_failure,
    judge,
    suspension_reason,
)
from hai.protocol import StopCause

S = JobState


def run(*ranks: int) -> tuple[RankReport, ...]:
    return tuple(RankReport(rank=r, running=True) for r in ranks)


def ex(**codes: int) -> tuple[RankReport, ...]:
    """ex(r0=0, r1=3): ranks 0 and 1 exited with those codes."""
    return tuple(RankReport(rank=int(k[1:]), running=False, exit_code=c) for k, c in codes.items())


def node(i: int, ranks=(), **kw) -> NodeReport:
    return NodeReport(node=f"n{i}", node_rank=i, ranks=tuple(ranks), **kw)


def facts(state: JobState, *reports: NodeReport, nodes: int | None = None, expected: int = 1) -> AttemptReports:
    return AttemptReports(state=state, expected_ranks=expected, nodes=len(reports) if nodes is None else nodes,
                          reports=tuple(reports))


CASES = [
    # (name, facts, verdict, rule, reason contains, exit code)
    ("a node's ranks fenced themselves: requeued, though the other node's rank failed in consequence",
     facts(S.RUNNING, node(0, ex(r0=1)), node(1, ex(r1=143), finished=True, stop_cause=StopCause.FENCED,
                                                stopped_reason="lease ran out")),
     Verdict.REQUEUED, "fenced", "node n1's agent lost the server past its lease", None),
    ("fenced while suspending: requeued, not a suspension",
     facts(S.SUSPENDING, node(0, ex(r0=143), finished=True, stop_cause=StopCause.FENCED)),
     Verdict.REQUEUED, "fenced", "requeued", None),
    ("launch error fails the job", facts(S.STARTING, node(0, launch_error="no such file: train.py")),
     Verdict.FAILED, "launch_failed", "could not launch on node n0: no such file", None),
    ("launch error fails a suspending job too", facts(S.SUSPENDING, node(0, run(0)), node(1, launch_error="boom")),
     Verdict.FAILED, "launch_failed", "node n1: boom", None),
    ("a rank exiting non-zero fails the job", facts(S.RUNNING, node(0, run(0)), node(1, ex(r1=3))),
     Verdict.FAILED, "rank_failed", "rank 1 on node n1 exited with code 3", 3),
    ("the agent's limit is named before a signalled rank",
     facts(S.RUNNING, node(0, ex(r0=137), stop_cause=StopCause.MAX_RUNTIME, stopped_reason="max_runtime_s=5s exceeded")),
     Verdict.FAILED, "rank_failed", "stopped on node n0: max_runtime_s=5s exceeded", None),
    ("a log watchdog stop fails the job", facts(S.RUNNING, node(0, run(0), stop_cause=StopCause.LOG_WATCHDOG)),
     Verdict.FAILED, "rank_failed", "stopped on node n0: log_watchdog", None),
    ("an unnamed agent stop fails the job", facts(S.RUNNING, node(0, run(0), stopped_reason="odd")),
     Verdict.FAILED, "rank_failed", "stopped on node n0: odd", None),
    ("every rank exited 0: succeeded", facts(S.RUNNING, node(0, ex(r0=0)), node(1, ex(r1=0))),
     Verdict.SUCCEEDED, "succeeded", "every rank exited 0", 0),
    ("starting and every rank reported: running", facts(S.STARTING, node(0, run(0, 1)), expected=2),
     Verdict.RUNNING, "all_ranks_started", "all ranks started", None),
    ("suspend_ready and every node stopped: suspended at the checkpoint",
     facts(S.SUSPENDING, node(0, ex(r0=143), suspend_ready=True, stop_cause=StopCause.SUSPEND,
                              stopped_reason="stopped after the job called suspend_ready()"),
           node(1, ex(r1=143), finished=True)),
     Verdict.SUSPENDED, "suspended", "", None),
    ("suspend grace expired: suspended without a checkpoint",
     facts(S.SUSPENDING, node(0, ex(r0=137), stop_cause=StopCause.SUSPEND_TIMEOUT, stopped_reason="grace")),
     Verdict.SUSPENDED, "suspended", "", None),
    ("never launched anywhere: suspended at no cost",
     facts(S.SUSPENDING, node(0, finished=True, stop_cause=StopCause.NOT_LAUNCHED)),
     Verdict.SUSPENDED, "suspended", "", None),
    ("exited 0 by itself while suspending: succeeded", facts(S.SUSPENDING, node(0, ex(r0=0))),
     Verdict.SUCCEEDED, "succeeded", "every rank exited 0", 0),
    ("exited non-zero while suspending without a checkpoint: failed", facts(S.SUSPENDING, node(0, ex(r0=2))),
     Verdict.FAILED, "rank_failed", "exited while suspending without reaching a checkpoint", 2),
]


@pytest.mark.parametrize(("name", "f", "verdict", "rule", "reason", "code"), CASES, ids=[c[0] for c in CASES])
def test_rule_decides(name, f, verdict, rule, reason, code):
    o = judge(f)
    assert o is not None and (o.verdict, o.rule, o.exit_code) == (verdict, rule, code)
    assert reason in o.reason


NOTHING_YET = [
    ("starting, a node has not reported", facts(S.STARTING, node(0, run(0)), nodes=2)),
    ("starting, a rank missing", facts(S.STARTING, node(0, run(0)), expected=2)),
    ("running and running", facts(S.RUNNING, node(0, run(0)))),
    ("suspending, a rank still runs", facts(S.SUSPENDING, node(0, run(0)), node(1, ex(r1=143), suspend_ready=True))),
    ("suspending, a node has not reported", facts(S.SUSPENDING, node(0, ex(r0=0), suspend_ready=True), nodes=2)),
    ("suspending, a rank failed but another runs", facts(S.SUSPENDING, node(0, run(0)), node(1, ex(r1=1)))),
    ("an unknown cause from a newer agent is not a failure", facts(S.RUNNING, node(0, run(0), stop_cause="brand_new"))),
    ("queued jobs are not judged", facts(S.QUEUED, node(0, ex(r0=1)))),
    ("terminal jobs are not judged", facts(S.FAILED, node(0, ex(r0=0)))),
]


@pytest.mark.parametrize(("name", "f"), NOTHING_YET, ids=[c[0] for c in NOTHING_YET])
def test_no_rule_fires_yet(name, f):
    assert judge(f) is None


def test_rules_are_in_precedence_order_and_lead_to_legal_states():
    assert [r.name for r in RULES] == ["fenced", "launch_failed", "rank_failed", "suspended", "succeeded",
                                      "all_ranks_started"]
    for rule in RULES:
        for state in rule.from_states:
            assert rule.to_state in allowed_targets(state), (rule.name, state)


@pytest.mark.parametrize(("name", "f"), [(c[0], c[1]) for c in CASES], ids=[c[0] for c in CASES])
def test_the_outcome_leads_where_its_rule_says(name, f):
    o = judge(f)
    (rule,) = [r for r in RULES if r.name == o.rule]
    assert o.target == rule.to_state and f.state in rule.from_states


def test_launch_failure_wins_over_a_failed_rank():
    f = facts(S.RUNNING, node(0, ex(r0=9)), node(1, launch_error="no GPU 3"))
    assert judge(f).rule == "launch_failed"


def test_the_first_own_failure_is_named_before_ranks_killed_by_a_signal():
    # rank 2 exited with its own code 4; ranks 0 and 1 were killed (negative = signal, sorts last)
    f = facts(S.RUNNING, node(0, ex(r0=-9)), node(1, ex(r1=-15, r2=4)))
    assert first_failure(f.reports) == ("rank 2 on node n1 exited with code 4", 4)


def test_the_lowest_node_rank_is_named_first():
    f = facts(S.RUNNING, node(1, ex(r8=1)), node(0, ex(r0=2)))
    assert judge(f).reason == "rank 0 on node n0 exited with code 2"


def test_a_suspension_at_a_checkpoint_loses_nothing():
    o = Outcome(Verdict.SUSPENDED, "suspended", at_checkpoint=True)
    assert suspension_reason(o, checkpoint_step=40, safe_at=100.0, now=160.0, gpus=16) == (
        "suspended at its checkpoint (step 40)", 0.0)


def test_a_forced_suspension_loses_the_gpu_time_since_the_last_safe_point():
    o = Outcome(Verdict.SUSPENDED, "suspended", forced_reason="the job did not call suspend_ready()")
    reason, lost = suspension_reason(o, checkpoint_step=None, safe_at=100.0, now=160.0, gpus=16)
    assert lost == 960.0
    assert reason == "stopped without a checkpoint (the job did not call suspend_ready()); 960 GPU-seconds of work lost"


def test_a_node_is_done_when_nothing_runs_and_nothing_more_will_start():
    assert node(0, ex(r0=0, r1=0)).done_with(2)
    assert not node(0, ex(r0=0)).done_with(2)  # rank 1 not started yet
    assert node(0, ex(r0=0), finished=True).done_with(2)
    assert node(0, launch_error="x").done_with(8)
    assert not node(0, run(0) + ex(r1=0)).done_with(2)


# -- what the agents are told ---------------------------------------------------------------
from hai.domain.jobs import assignment_action  # noqa: E402
from hai.protocol import DesiredAction  # noqa: E402

A = DesiredAction


@pytest.mark.parametrize(("state", "desired", "current", "action"), [
    (S.STARTING, A.RUN, True, A.RUN),
    (S.RUNNING, A.RUN, True, A.RUN),
    (S.RUNNING, A.RUN, False, A.STOP),  # an older attempt of the job
    (S.SUSPENDING, A.SUSPEND, True, A.SUSPEND),
    (S.SUSPENDING, A.SUSPEND, False, A.STOP),
    (S.RUNNING, A.STOP, True, A.STOP),
    (S.CANCELLED, A.STOP, True, A.STOP),
    (S.FAILED, A.STOP, True, A.STOP),
    (S.SUCCEEDED, A.STOP, True, A.STOP),
    (S.QUEUED, A.RUN, True, A.STOP),  # requeued: whatever still runs of it stops
])
def test_the_action_an_agent_is_told(state, desired, current, action):
    assert assignment_action(state, desired, current_attempt=current) == action
    assert assignment_action(state, desired.value, current_attempt=current) == action  # as read from the column
