"""The reaper: nodes whose agent has been silent past agent.lost_after_s become ``lost``; their
GPUs are given up and the jobs that ran there go back to the queue from their last checkpoint
(a restart, not a suspension and not the job's failure). A lost node takes work again only
after its agent is back and a validation passes (services/node_health.on_register)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from hai.db.base import utcnow
from hai.db.models import JobAllocation, Node
from hai.domain.jobs import ACTIVE_STATES, JobState
from hai.domain.nodes import NodeState
from hai.services import notify
from hai.services.jobs import publish_after_commit, requeue_as_restart
from hai.services.node_state import set_node_state
from hai.services.reports import release
from hai.settings import Settings


def mark_lost_nodes(*, session: Session, settings: Settings, now: datetime | None = None) -> list[str]:
    now = now or utcnow()
    cutoff = now - timedelta(seconds=settings.agent.lost_after_s)
    lost = list(
        session.scalars(
            select(Node)
            .where(Node.state != NodeState.LOST.value, Node.last_heartbeat_at.is_not(None), Node.last_heartbeat_at < cutoff)
            .order_by(Node.name)
            .with_for_update()
        )
    )
    # a lost node whose agent came back and then went silent again before its validation ended
    lost_again = list(
        session.scalars(
            select(Node)
            .where(Node.state == NodeState.LOST.value, Node.return_validation_id.is_not(None),
                   Node.last_heartbeat_at < cutoff)
            .with_for_update()
        )
    )
    for node in lost_again:
        node.return_validation_id = None
    for node in lost:
        assert node.last_heartbeat_at is not None
        # remember an admin's drain or a fault: the node returns to it, not to ready
        was = {"was": node.state, "was_reason": node.state_reason} if node.state != NodeState.READY.value else {}
        set_node_state(session, node, NodeState.LOST, actor="reaper",
                       reason=f"no heartbeat since {node.last_heartbeat_at.isoformat()}",
                       detail={"silent_since": node.last_heartbeat_at.isoformat(), **was}, now=now)
        node.return_validation_id = None
        allocs = list(
            session.scalars(
                select(JobAllocation).where(JobAllocation.node_name == node.name, JobAllocation.active.is_(True))
            )
        )
        for alloc in allocs:
            release(alloc, now)
            job = alloc.job
            if alloc.attempt == job.attempt and JobState(job.state) in ACTIVE_STATES:
                requeue_as_restart(session, job, reason=f"node {node.name} was lost; requeued", now=now,
                                   pending_reason=f"requeued after node {node.name} was lost")
    if lost:
        publish_after_commit(session, notify.SCHEDULER)
    session.commit()
    return [n.name for n in lost]
