"""The one seam between the Kubernetes backend and the service layer. Every call into
``hai.services`` (and the few queries the backend needs) lives here, so that the ongoing
restructuring of ``services/agents.py`` only has to be followed in this file.

The backend is a fleet of virtual agents: it speaks the agent protocol (register, heartbeat)
in process, so the job-outcome rules are the agents' rules.
"""

from __future__ import annotations

from sqlalchemy import select

from hai.db.base import utcnow
from hai.db.models import Job, JobAllocation, Node
from hai.domain.jobs import JobState, assignment_action
from hai.domain.nodes import NodeState
from hai.services.errors import Conflict
from hai.services.node_state import set_node_state
from hai.protocol import AgentHello, Heartbeat, LogBatch, ServerReply
from hai.services import agents as agent_service
from hai.services import logs as log_service
from hai.services import notify
from hai.services.context import Platform
from hai.services.jobs import publish_after_commit, transition


def register(platform: Platform, hello: AgentHello) -> ServerReply:
    with platform.sessions() as session:
        return agent_service.register(session=session, hello=hello, settings=platform.settings)


def heartbeat(platform: Platform, hb: Heartbeat) -> ServerReply:
    with platform.sessions() as session:
        return agent_service.heartbeat(session=session, hb=hb, settings=platform.settings)


def heartbeats(platform: Platform, hbs: list[Heartbeat]) -> list[ServerReply]:
    """Several nodes' heartbeats in one transaction (``services.agents.heartbeats``)."""
    with platform.sessions() as session:
        return agent_service.heartbeats(session=session, hbs=hbs, settings=platform.settings)


def digest(reply: ServerReply) -> str:
    return agent_service.digest(reply.assignments)


def append_logs(platform: Platform, batch: LogBatch) -> int:
    with platform.sessions() as session:
        return log_service.append_batch(
            session=session, batch=batch, max_line_chars=platform.settings.limits.max_log_line_chars
        )


def _action(alloc_attempt: int, job_attempt: int, state: str, desired: str) -> str:
    # the agents' own rule (domain.jobs.assignment_action), so fingerprints match the replies
    return assignment_action(JobState(state), desired, current_attempt=alloc_attempt == job_attempt).value


def fingerprint(items) -> int:
    """A node's assignments as (job_id, attempt, action), order-independent."""
    return hash(tuple(sorted(items)))


def reply_fingerprint(reply: ServerReply) -> int:
    return fingerprint((a.job_id, a.attempt, a.action) for a in reply.assignments)


def assignment_fingerprints(platform: Platform) -> dict[str, int]:
    """Per node holding active allocations, the fingerprint of the assignments its next reply
    would carry, for the whole cluster in one query: a node whose fingerprint equals that of its
    last reply needs no heartbeat to learn new assignments."""
    with platform.sessions() as session:
        rows = session.execute(
            select(JobAllocation.node_name, JobAllocation.job_id, JobAllocation.attempt, Job.attempt, Job.state,
                   Job.desired_action)
            .join(Job, Job.id == JobAllocation.job_id)
            .where(JobAllocation.active)
        ).all()
    out: dict[str, list] = {}
    for node, job_id, alloc_attempt, job_attempt, state, desired in rows:
        out.setdefault(node, []).append((job_id, alloc_attempt, _action(alloc_attempt, job_attempt, state, desired)))
    return {node: fingerprint(v) for node, v in out.items()}


def touch_idle_nodes(platform: Platform, names: list[str]) -> int:
    """Liveness for nodes with nothing to report and nothing assigned, in one statement: what an
    empty heartbeat would do (last_heartbeat_at; the reaper marks silent nodes lost). A node
    the server does not know or marked lost is not touched: it gets a real heartbeat."""
    if not names:
        return 0
    from sqlalchemy import update

    with platform.sessions() as session:
        n = session.execute(
            update(Node).where(Node.name.in_(names), Node.state != NodeState.LOST.value).values(last_heartbeat_at=utcnow())
        ).rowcount
        session.commit()
        return n or 0


def node_states(platform: Platform) -> dict[str, tuple[str, str]]:
    with platform.sessions() as session:
        return {n.name: (n.state, n.state_reason) for n in session.scalars(select(Node))}


# Node state changes the backend makes on the platform's side go through the node state machine
# (services/node_state.set_node_state, actor "kubernetes"), like every other change.
K8S_REASON_PREFIX = "kubernetes: "


def sync_node_state(platform: Platform, name: str, state: str, reason: str) -> bool:
    """Mirror a Kubernetes Node's condition (cordon, NotReady) onto the platform node. A state the
    platform set itself (a drain, lost) is left alone; a state that came from Kubernetes is undone
    once Kubernetes clears it. True when something changed."""
    with platform.sessions() as session:
        node = session.scalar(select(Node).where(Node.name == name).with_for_update())
        if node is None:
            return False
        ours = node.state_reason.startswith(K8S_REASON_PREFIX)
        if state == NodeState.READY.value:
            if node.state == NodeState.READY.value or not ours:
                session.rollback()
                return False
            target, why = NodeState.READY, K8S_REASON_PREFIX + "schedulable and Ready again"
        else:
            if node.state in (NodeState.DRAINING.value, NodeState.DRAINED.value, NodeState.LOST.value) and not ours:
                session.rollback()
                return False  # the platform's own drain (or the reaper) wins
            want = K8S_REASON_PREFIX + reason
            if node.state == state and node.state_reason == want:
                session.rollback()
                return False
            target, why = NodeState(state), want
        if node.state == target.value:  # same state, new reason: no transition to record
            node.state_reason = why
        else:
            try:
                set_node_state(session, node, target, actor="kubernetes", reason=why)
            except Conflict:
                session.rollback()
                return False
        publish_after_commit(session, notify.SCHEDULER)
        session.commit()
        return True


def requeue_not_started(platform: Platform, job_id: int, attempt: int, reason: str) -> bool:
    """Gang timeout: the attempt never ran as a whole. Back to the queue as not started: no
    restart counted, no failure, no lost work charged (the attempt's run time stays as the
    state machine books it for any ended attempt). The allocations become ``stop``; the GPUs
    are released once the nodes report the pods gone."""
    with platform.sessions() as session:
        job = session.get(Job, job_id, with_for_update=True)
        if job is None or job.attempt != attempt or job.state not in (JobState.STARTING.value, JobState.RUNNING.value):
            session.rollback()
            return False
        transition(session, job, JobState.QUEUED, reason=reason, now=utcnow())
        job.pending_reason = "requeued: its pods did not all start in time (not started, not charged)"
        session.commit()
        return True
