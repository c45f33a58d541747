"""The one place that changes a node's state (as services/jobs.transition is for jobs).

``set_node_state`` checks the change is legal (domain/nodes.py), records a NodeEvent (time,
from, to, actor, reason) and wakes the scheduler and the node's long poll. It flushes; the
caller's service commits. ``create_node`` is the one writer of a new node's first state.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from hai.db.base import utcnow
from hai.db.models import Node, NodeEvent
from hai.domain.nodes import IllegalNodeTransition, NodeState, check_node_transition
from hai.services import notify
from hai.services.errors import Conflict
from hai.services.jobs import publish_after_commit


def set_node_state(
    session: Session,
    node: Node,
    target: NodeState,
    *,
    actor: str,
    reason: str,
    detail: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> None:
    now = now or utcnow()
    current = NodeState(node.state)
    try:
        check_node_transition(current, target)
    except IllegalNodeTransition as exc:
        raise Conflict(f"node {node.name}: {exc}") from exc
    node.state = target.value
    node.state_reason = reason[:512]
    node.state_detail = detail
    node.state_changed_at = now
    node.events.append(NodeEvent(at=now, from_state=current.value, to_state=target.value, actor=actor,
                                 reason=reason, detail=detail))
    session.flush()
    publish_after_commit(session, notify.SCHEDULER, notify.node_topic(node.name))


def create_node(session: Session, *, name: str, state: NodeState, actor: str, reason: str,
                now: datetime | None = None, **fields: Any) -> Node:
    now = now or utcnow()
    node = Node(name=name, state=state.value, state_reason=reason, state_changed_at=now, registered_at=now, **fields)
    node.events = [NodeEvent(at=now, from_state=None, to_state=state.value, actor=actor, reason=reason)]
    session.add(node)
    session.flush()
    return node
