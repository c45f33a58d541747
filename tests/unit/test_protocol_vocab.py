"""The protocol's vocabularies are str enums: the wire strings stay what they were, and a stop
cause this side does not know (a newer agent) is kept as a plain string instead of refusing
the whole heartbeat."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from hai.agent.testing import assignment
from hai.protocol import Assignment, AttemptStatus, DesiredAction, StopCause


def test_the_wire_strings_are_the_ones_of_protocol_version_1():
    # "fenced" was added within version 1 (issue 13): a server that does not know a cause reads it
    # as a string and does not fail the job for it (test_job_outcomes: "an unknown cause ...")
    assert [c.value for c in StopCause] == ["requested", "suspend", "suspend_timeout", "max_runtime", "log_watchdog",
                                            "rank_failed", "unassigned", "not_launched", "fenced"]
    assert [a.value for a in DesiredAction] == ["run", "suspend", "stop"]
    st = AttemptStatus(job_id=1, attempt=2, stop_cause=StopCause.SUSPEND_TIMEOUT)
    assert json.loads(st.model_dump_json())["stop_cause"] == "suspend_timeout"
    assert f"{StopCause.MAX_RUNTIME}" == "max_runtime" and str(DesiredAction.STOP) == "stop"


def test_known_strings_parse_to_members_and_unknown_causes_stay_strings():
    st = AttemptStatus.model_validate_json('{"job_id": 1, "attempt": 1, "stop_cause": "log_watchdog"}')
    assert st.stop_cause is StopCause.LOG_WATCHDOG
    newer = AttemptStatus.model_validate_json('{"job_id": 1, "attempt": 1, "stop_cause": "gpu_fell_off_the_bus"}')
    assert newer.stop_cause == "gpu_fell_off_the_bus" and not isinstance(newer.stop_cause, StopCause)


def test_an_assignment_action_is_one_of_the_three():
    a = assignment(1, ["true"], action="suspend")
    assert a.action is DesiredAction.SUSPEND
    with pytest.raises(ValidationError):
        Assignment.model_validate({**a.model_dump(mode="json"), "action": "pause"})
