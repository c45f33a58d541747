"""The node lifecycle: one legal-transition table, as for jobs (domain/jobs.py).

Every change of a node's state goes through ``services.node_state.set_node_state``, which asks
``check_node_transition`` here first and records a node event. Pure rules about validator
results live here too: what a run's outcome is and how a failed check reads as a reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hai.protocol.node_state import NodeState

__all__ = [
    "NodeState",
    "IllegalNodeTransition",
    "SCHEDULABLE_STATES",
    "HOLDING_STATES",
    "allowed_node_targets",
    "check_node_transition",
    "FailedCheck",
    "failed_critical",
    "failure_reason",
]

S = NodeState

# nodes the scheduler may place work on
SCHEDULABLE_STATES = frozenset({S.READY})
# out of service on purpose: an undrain (gated by a full validation) brings them back
HOLDING_STATES = frozenset({S.DRAINING, S.DRAINED, S.UNHEALTHY})


class IllegalNodeTransition(Exception):
    def __init__(self, current: NodeState, target: NodeState):
        super().__init__(f"a node in state '{current.value}' cannot become '{target.value}'")
        self.current = current
        self.target = target


_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    # drain: DRAINING while jobs still hold GPUs there, DRAINED at once when none do
    S.READY: frozenset({S.DRAINING, S.DRAINED, S.UNHEALTHY, S.LOST}),
    S.DRAINING: frozenset({S.DRAINED, S.READY, S.UNHEALTHY, S.LOST}),
    S.DRAINED: frozenset({S.READY, S.UNHEALTHY, S.LOST}),
    # an unhealthy node stays out until an undrain passes (or is forced)
    S.UNHEALTHY: frozenset({S.READY, S.LOST}),
    # the agent is back: READY only after a passing validation, UNHEALTHY when it fails;
    # DRAINED/UNHEALTHY when it was taken out before it went silent
    S.LOST: frozenset({S.READY, S.UNHEALTHY, S.DRAINED}),
}


def allowed_node_targets(current: NodeState) -> frozenset[NodeState]:
    return _TRANSITIONS[current]


def check_node_transition(current: NodeState, target: NodeState) -> None:
    """Raise IllegalNodeTransition unless current -> target is in the table."""
    if target not in _TRANSITIONS[current]:
        raise IllegalNodeTransition(current, target)


@dataclass(frozen=True, slots=True)
class FailedCheck:
    name: str
    value: float | None
    threshold: float | None
    unit: str
    detail: str


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:g}" if abs(x) >= 0.01 or x == 0 else f"{x:.3g}"


def failed_critical(checks: Iterable[dict]) -> list[FailedCheck]:
    """The critical checks of a run that failed, in the run's order. ``checks``: dicts with the
    fields of protocol CheckResult."""
    return [
        FailedCheck(name=c["name"], value=c.get("value"), threshold=c.get("threshold"), unit=c.get("unit") or "",
                    detail=c.get("detail") or "")
        for c in checks
        if c.get("critical") and c.get("status") == "failed"
    ]


def failure_reason(failed: list[FailedCheck]) -> str:
    """One line naming each failed check with its value and threshold."""
    parts = []
    for f in failed:
        text = f"check {f.name} failed: value {_fmt(f.value)} {f.unit}".rstrip()
        text += f", threshold {_fmt(f.threshold)} {f.unit}".rstrip()
        if f.detail:
            text += f" ({f.detail})"
        parts.append(text)
    return "; ".join(parts)
