"""The agent's supervision deadlines as a pure rule: records and times in, stop/kill/nothing out.
No processes, no files."""

from __future__ import annotations

from pathlib import Path

import pytest

from hai.agent.attempts import Attempt, Rank
from hai.agent.supervision import KILL, READY_EXIT_WINDOW_S, Due, deadline, grace_s, suspend_ready_seen
from hai.agent.testing import assignment
from hai.protocol import StopCause

T0 = 1000.0
GRACE = 10.0


def att(*, ranks: int = 2, started: float | None = T0, **spec) -> Attempt:
    a = Attempt(job_id=1, attempt=1, spec=assignment(1, ["true"], **spec).spec, dir=Path("/nonexistent"),
                created_at=T0, started_at=started, attached_at=T0)
    a.ranks = [Rank(rank=i, local_rank=i, gpus=[i], pid=100 + i) for i in range(ranks)]
    return a


def due(a: Attempt, now: float) -> Due | None:
    return deadline(a, now, kill_grace_s=GRACE)


def test_nothing_is_due_for_a_healthy_attempt():
    assert due(att(), T0 + 3600) is None


def test_a_failed_rank_stops_the_others():
    a = att()
    a.ranks[1].ended, a.ranks[1].exit_code = True, 3
    assert due(a, T0 + 1) == Due("stop", StopCause.RANK_FAILED, "rank 1 exited with code 3")


def test_ranks_that_exited_zero_stop_nothing():
    a = att()
    a.ranks[1].ended, a.ranks[1].exit_code = True, 0
    assert due(a, T0 + 1) is None


def test_nothing_is_due_once_every_rank_ended():
    a = att(max_runtime_s=1)
    for r in a.ranks:
        r.ended, r.exit_code = True, 1
    assert due(a, T0 + 100) is None


def test_after_suspend_ready_the_ranks_get_a_short_window_to_exit():
    a = att()
    a.suspend_requested_at, a.ready_at = T0, T0 + 5
    assert due(a, T0 + 5 + READY_EXIT_WINDOW_S - 0.01) is None
    assert due(a, T0 + 5 + READY_EXIT_WINDOW_S) == Due(
        "stop", StopCause.SUSPEND, "stopped after the job called suspend_ready()")


def test_the_ready_window_is_never_longer_than_the_stop_grace():
    a = att(stop_grace_s=0.5)
    a.suspend_requested_at, a.ready_at = T0, T0
    assert due(a, T0 + 0.5).cause == StopCause.SUSPEND


def test_a_suspend_without_suspend_ready_times_out_after_its_grace():
    a = att(suspend_grace_s=30)
    a.suspend_requested_at = T0 + 10
    assert due(a, T0 + 39.9) is None
    d = due(a, T0 + 40)
    assert d.action == "stop" and d.cause == StopCause.SUSPEND_TIMEOUT
    assert d.reason == "the job did not call suspend_ready() within suspend_grace_s=30s"


def test_max_runtime_counts_from_the_start():
    a = att(max_runtime_s=60)
    assert due(a, T0 + 59) is None
    assert due(a, T0 + 60) == Due("stop", StopCause.MAX_RUNTIME, "max_runtime_s=60s exceeded")


def test_nothing_started_nothing_timed():
    assert due(att(started=None, max_runtime_s=1, log_watchdog_s=1), T0 + 100) is None


@pytest.mark.parametrize(("attached", "last_output", "blind", "quiet_from"), [
    (T0, None, None, T0),  # silent since the start
    (T0 + 50, None, None, T0 + 50),  # a restarted agent counts from when it took charge
    (T0, T0 + 70, None, T0 + 70),  # from the last line
    (T0, T0 + 10, T0 + 90, T0 + 90),  # from the last moment the log folder was full (issue 13)
])
def test_the_log_watchdog_counts_from_the_latest_sign_of_life(attached, last_output, blind, quiet_from):
    a = att(log_watchdog_s=20)
    a.attached_at = attached
    a.blind_at = blind

    class Tail:
        last_output_at = last_output

    a.tail = Tail()  # type: ignore[assignment]
    assert due(a, quiet_from + 19.9) is None
    assert due(a, quiet_from + 20) == Due("stop", StopCause.LOG_WATCHDOG, "no output for log_watchdog_s=20s")


def test_a_failed_rank_is_named_before_a_limit():
    a = att(max_runtime_s=1)
    a.ranks[0].ended, a.ranks[0].exit_code = True, 9
    assert due(a, T0 + 100).cause == StopCause.RANK_FAILED


def test_sigkill_follows_sigterm_after_the_grace():
    a = att()
    a.term_sent_at, a.stop_cause = T0 + 100, StopCause.REQUESTED
    assert due(a, T0 + 100 + GRACE - 0.01) is None
    assert due(a, T0 + 100 + GRACE) is KILL
    a.kill_sent = True
    assert due(a, T0 + 1000) is None


def test_the_spec_grace_wins_over_the_agent_default():
    a = att(stop_grace_s=2)
    assert grace_s(a, GRACE) == 2 and grace_s(att(), GRACE) == GRACE
    a.term_sent_at = T0
    assert due(a, T0 + 2) is KILL


def test_a_stopping_attempt_gets_no_second_stop():
    a = att(max_runtime_s=1)
    a.term_sent_at = T0 + 5
    assert due(a, T0 + 6) is None


def test_suspend_ready_counts_only_after_the_request():
    a = att()
    a.suspend_requested_at = T0 + 10
    a.ranks[0].ready_at = T0 + 5  # an earlier round's suspend_ready()
    assert not suspend_ready_seen(a)
    a.ranks[1].ready_at = T0 + 10.5
    assert suspend_ready_seen(a)
    assert not suspend_ready_seen(att())
