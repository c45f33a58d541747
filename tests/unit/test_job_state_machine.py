"""Every transition of the job state machine, legal or not."""

from __future__ import annotations

import itertools

import pytest

from hai.domain.jobs import IllegalTransition, JobState, Priority, allowed_targets, check_transition

S = JobState
LEGAL = {
    (S.QUEUED, S.STARTING), (S.QUEUED, S.CANCELLED), (S.QUEUED, S.FAILED),
    (S.STARTING, S.RUNNING), (S.STARTING, S.SUSPENDING), (S.STARTING, S.SUCCEEDED), (S.STARTING, S.FAILED),
    (S.STARTING, S.CANCELLED), (S.STARTING, S.QUEUED),
    (S.RUNNING, S.SUSPENDING), (S.RUNNING, S.SUCCEEDED), (S.RUNNING, S.FAILED), (S.RUNNING, S.CANCELLED),
    (S.RUNNING, S.QUEUED),
    (S.SUSPENDING, S.QUEUED), (S.SUSPENDING, S.SUCCEEDED), (S.SUSPENDING, S.FAILED), (S.SUSPENDING, S.CANCELLED),
    (S.FAILED, S.QUEUED),  # issue 10: failed on a node found faulty soon after -> requeued
}
ALL_PAIRS = list(itertools.product(JobState, JobState))


@pytest.mark.parametrize(("current", "target"), sorted(LEGAL, key=str))
def test_legal_transition_is_allowed(current, target):
    check_transition(current, target)
    assert target in allowed_targets(current)


@pytest.mark.parametrize(("current", "target"), [p for p in ALL_PAIRS if p not in LEGAL], ids=str)
def test_every_other_transition_is_refused(current, target):
    with pytest.raises(IllegalTransition) as exc:
        check_transition(current, target)
    assert current.value in str(exc.value) and target.value in str(exc.value)


@pytest.mark.parametrize("state", [S.SUCCEEDED, S.CANCELLED])
def test_terminal_states_allow_nothing(state):
    assert state.terminal and allowed_targets(state) == frozenset()


def test_failed_allows_only_the_faulty_node_requeue():
    assert S.FAILED.terminal and allowed_targets(S.FAILED) == frozenset({S.QUEUED})


def test_active_states_are_those_holding_gpus():
    assert {s for s in JobState if s.active} == {S.STARTING, S.RUNNING, S.SUSPENDING}


def test_priority_order():
    order = ["LOW", "NORMAL", "ABOVE_NORMAL", "HIGH", "VERY_HIGH", "EXTREME_HIGH"]
    assert sorted(Priority, key=lambda p: p.rank) == [Priority(p) for p in order]
    assert Priority.LOW < Priority.NORMAL < Priority.EXTREME_HIGH
    assert max(Priority) == Priority.EXTREME_HIGH
