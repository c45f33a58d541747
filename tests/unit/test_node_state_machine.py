"""The node lifecycle table (issue 10) and the pure rules about validator results."""

from __future__ import annotations

import itertools

import pytest

from hai.domain.nodes import (
    IllegalNodeTransition,
    NodeState as S,
    SCHEDULABLE_STATES,
    allowed_node_targets,
    check_node_transition,
    failed_critical,
    failure_reason,
)

LEGAL = {
    (S.READY, S.DRAINING), (S.READY, S.DRAINED), (S.READY, S.UNHEALTHY), (S.READY, S.LOST),
    (S.DRAINING, S.DRAINED), (S.DRAINING, S.READY), (S.DRAINING, S.UNHEALTHY), (S.DRAINING, S.LOST),
    (S.DRAINED, S.READY), (S.DRAINED, S.UNHEALTHY), (S.DRAINED, S.LOST),
    (S.UNHEALTHY, S.READY), (S.UNHEALTHY, S.LOST),
    (S.LOST, S.READY), (S.LOST, S.UNHEALTHY), (S.LOST, S.DRAINED),
}


@pytest.mark.parametrize("current,target", sorted(itertools.product(S, S), key=lambda p: (p[0].value, p[1].value)),
                         ids=lambda s: s.value)
def test_every_pair_is_legal_exactly_when_the_table_says(current, target):
    if (current, target) in LEGAL:
        check_node_transition(current, target)
        assert target in allowed_node_targets(current)
    else:
        with pytest.raises(IllegalNodeTransition, match=f"'{current.value}' cannot become '{target.value}'"):
            check_node_transition(current, target)


def test_no_state_transitions_to_itself_and_only_ready_is_schedulable():
    assert all(s not in allowed_node_targets(s) for s in S)
    assert SCHEDULABLE_STATES == {S.READY}


def test_an_unhealthy_node_cannot_be_drained_or_skip_the_undrain_gate():
    assert allowed_node_targets(S.UNHEALTHY) == {S.READY, S.LOST}


def test_node_state_values_are_the_wire_strings():
    assert [s.value for s in S] == ["ready", "draining", "drained", "unhealthy", "lost"]
    assert S("lost") is S.LOST and S.LOST == "lost"


def test_failed_critical_keeps_only_critical_failures_in_order():
    checks = [
        {"name": "gpu_count", "critical": True, "status": "passed", "value": 8, "threshold": 8, "unit": "GPUs"},
        {"name": "host_mem_bw", "critical": False, "status": "failed", "value": 1.0, "threshold": 2.0, "unit": "GB/s"},
        {"name": "gpu_xid", "critical": True, "status": "failed", "value": 1, "threshold": 0, "unit": "events",
         "detail": "Xid 79 (GPU has fallen off the bus)"},
        {"name": "gemm_tflops", "critical": True, "status": "skipped", "detail": "no CUDA"},
    ]
    failed = failed_critical(checks)
    assert [f.name for f in failed] == ["gpu_xid"]
    text = failure_reason(failed)
    assert text == "check gpu_xid failed: value 1 events, threshold 0 events (Xid 79 (GPU has fallen off the bus))"
