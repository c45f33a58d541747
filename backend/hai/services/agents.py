"""The server side of the agent protocol: the handshake, heartbeats (apply the agent's report,
answer with the node's assignments). The reaper that marks silent nodes lost
is services/reaper.py; node health (validator runs, moving jobs off a node) is
services/node_health.py, called from the hooks marked "issue 10".

What a report means for a job lives in ``services.reports`` (rules: ``hai.domain.outcomes``);
what a node should run in ``services.assignments``. A heartbeat builds the node's assignment
list once (one query of its active allocations, which the report is applied to; the list is
built from those still active): it is both what the agent's digest is checked against
(an agent holding exactly that list and not reporting a ``stop`` attempt has nothing of it
running: its GPUs are released) and the reply.
"""

from __future__ import annotations

import logging
from sqlalchemy import select
from sqlalchemy.orm import Session

from hai.db.base import utcnow
from hai.db.models import Node
from hai.domain.nodes import NodeState
from hai.protocol import SUPPORTED_VERSIONS, AgentHello, Assignment, Heartbeat, ServerReply
from hai.services import metrics_store, node_health, notify, reports
from hai.services.assignments import active_allocations, assigned, assignments_for, digest
from hai.services.errors import UnsupportedProtocol
from hai.services.jobs import publish_after_commit
from hai.services.node_state import create_node
from hai.settings import Settings

log = logging.getLogger(__name__)


def _check_version(version: int) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedProtocol(
            f"agent protocol version {version} is not supported; the server speaks {sorted(SUPPORTED_VERSIONS)}"
        )


def register(*, session: Session, hello: AgentHello, settings: Settings) -> ServerReply:
    _check_version(hello.protocol_version)
    now = utcnow()
    node = session.scalar(select(Node).where(Node.name == hello.node).with_for_update())
    if node is None:  # issue 10: the node's first state goes through node_state
        node = create_node(session, name=hello.node, state=NodeState.READY, actor="agent",
                           reason="agent registered", now=now)
    if not node.labels_from_topology:
        if hello.zone:
            node.zone = hello.zone
        if hello.leaf:
            node.leaf = hello.leaf
    node.zone = node.zone or "default"
    node.leaf = node.leaf or "default"
    node.gpus = len(hello.gpus)
    node.address = hello.address
    node.fake_gpus = hello.fake_gpus
    node.gpu_inventory = [g.model_dump() for g in hello.gpus]
    node.nics = [n.model_dump() for n in hello.nics]
    node.agent_version = hello.agent_version
    node.protocol_version = hello.protocol_version
    node.last_heartbeat_at = now
    node_health.on_register(session, node, settings=settings, now=now)  # issue 10: lost -> validate first
    session.flush()
    allocs = active_allocations(session, node.name)
    reports.apply_reports(session, allocs, hello.attempts, now=now)
    node_health.settle(session, node, now=now)  # issue 10
    reply = _reply(session, node, [a for _, a in assigned(allocs, settings)], settings)
    publish_after_commit(session, notify.SCHEDULER)
    session.commit()
    return reply


def heartbeat(*, session: Session, hb: Heartbeat, settings: Settings) -> ServerReply:
    _check_version(hb.protocol_version)
    now = utcnow()
    node = session.scalar(select(Node).where(Node.name == hb.node))
    if node is None:
        return ServerReply(node=hb.node, assignments_digest="", reregister=True)
    if node_health.must_reregister(node):  # issue 10
        # the server gave this node's work away; the agent must hand in its inventory again
        session.commit()
        return ServerReply(node=hb.node, assignments_digest="", reregister=True)
    node.last_heartbeat_at = now
    if hb.gpus:
        node.gpu_metrics = [g.model_dump() for g in hb.gpus]
    metrics_store.record_heartbeat(session=session, node=node.name, gpus=hb.gpus, now=now, settings=settings)
    allocs = active_allocations(session, node.name)
    reported = reports.apply_reports(session, allocs, hb.attempts, now=now)
    held = assigned(allocs, settings)
    if hb.assignments_digest is not None and hb.assignments_digest == digest([a for _, a in held]):
        held, changed = reports.release_unreported_stops(session, held, reported, now=now)
        if changed:  # rare: a job moved on; its other allocations' actions may read differently
            held = assigned(allocs, settings)
    # issue 10: validation reports; a failed critical check moves this node's jobs (their actions change)
    if node_health.on_heartbeat(session, node, hb.validations, settings=settings, now=now):
        held = assigned(allocs, settings)
    reply = _reply(session, node, [a for _, a in held], settings)
    session.commit()
    return reply


def current_reply(*, session: Session, node_name: str, settings: Settings) -> ServerReply:
    node = session.scalar(select(Node).where(Node.name == node_name))
    if node is None or node_health.must_reregister(node):  # issue 10
        return ServerReply(node=node_name, assignments_digest="", reregister=True)
    reply = _reply(session, node, assignments_for(session, node.name, settings), settings)
    session.commit()
    return reply


def _reply(session: Session, node: Node, assignments: list[Assignment], settings: Settings) -> ServerReply:
    return ServerReply(
        node=node.name,
        assignments=assignments,
        assignments_digest=digest(assignments),
        heartbeat_interval_s=settings.agent.heartbeat_interval_s,
        lost_after_s=settings.agent.lost_after_s,  # issue 13: the agent fences itself before this
        validations=node_health.pending_requests(session, node),  # issue 10
    )


