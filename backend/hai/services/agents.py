"""The server side of the agent protocol: handshake, heartbeat reconciliation, assignments,
and the reaper that marks silent nodes lost.

The agent reports the full state of every attempt it holds; reconciling a report is
idempotent. Each job's state follows from its allocations' reports; GPUs stay held
(allocation ``active``) until the agent says the ranks on that node are gone.
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from hai.db.base import utcnow
from hai.db.models import Job, JobAllocation, Node
from hai.domain.jobs import ACTIVE_STATES, JobState
from hai.protocol import (
    SUPPORTED_VERSIONS,
    AgentHello,
    Assignment,
    AttemptStatus,
    Heartbeat,
    LaunchSpec,
    ServerReply,
)
from hai.services import metrics_store, notify
from hai.services.errors import UnsupportedProtocol
from hai.services.jobs import publish_after_commit, transition
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
    if node is None:
        node = Node(name=hello.node, registered_at=now)
        session.add(node)
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
    if node.state == "lost":
        node.state = "ready"
        node.state_reason = "agent registered again"
    session.flush()
    _reconcile(session, node, hello.attempts, agent_digest=None, now=now, settings=settings)
    reply = _reply(session, node, settings)
    publish_after_commit(session, notify.SCHEDULER)
    session.commit()
    return reply


def heartbeat(*, session: Session, hb: Heartbeat, settings: Settings) -> ServerReply:
    _check_version(hb.protocol_version)
    now = utcnow()
    node = session.scalar(select(Node).where(Node.name == hb.node))
    if node is None:
        return ServerReply(node=hb.node, assignments_digest="", reregister=True)
    if node.state == "lost":
        # the server gave this node's work away; the agent must hand in its inventory again
        session.commit()
        return ServerReply(node=hb.node, assignments_digest="", reregister=True)
    node.last_heartbeat_at = now
    if hb.gpus:
        node.gpu_metrics = [g.model_dump() for g in hb.gpus]
    metrics_store.record_heartbeat(session=session, node=node.name, gpus=hb.gpus, now=now, settings=settings)
    _reconcile(session, node, hb.attempts, agent_digest=hb.assignments_digest, now=now, settings=settings)
    reply = _reply(session, node, settings)
    session.commit()
    return reply


def current_reply(*, session: Session, node_name: str, settings: Settings) -> ServerReply:
    node = session.scalar(select(Node).where(Node.name == node_name))
    if node is None or node.state == "lost":
        return ServerReply(node=node_name, assignments_digest="", reregister=True)
    reply = _reply(session, node, settings)
    session.commit()
    return reply


# -- assignments ---------------------------------------------------------------------------
def _action(job: Job, alloc: JobAllocation) -> str:
    if alloc.attempt != job.attempt:
        return "stop"
    if job.state in (JobState.STARTING.value, JobState.RUNNING.value) and job.desired_action == "run":
        return "run"
    if job.state == JobState.SUSPENDING.value:
        return "suspend"
    return "stop"


def _expected_ranks(job: Job) -> int:
    return 1 if job.job_type == "command" else job.gpus_per_node


def _launch_spec(job: Job, alloc: JobAllocation, settings: Settings) -> LaunchSpec:
    ckpt = job.last_checkpoint or {}
    return LaunchSpec(
        job_name=job.name,
        user=job.user_name,
        command=list(job.command),
        env=dict(job.env or {}),
        job_type=job.job_type,  # type: ignore[arg-type]
        gpus=list(alloc.gpus),
        node_rank=alloc.node_rank,
        nnodes=job.nodes,
        gpus_per_node=job.gpus_per_node,
        master_addr=job.master_addr or "127.0.0.1",
        master_port=job.master_port or settings.agent.master_port_base,
        restart_count=max(0, alloc.attempt - 1),
        resume_from=ckpt.get("path") if alloc.attempt > 1 else None,
        suspend_grace_s=job.suspend_grace_s,
        log_watchdog_s=job.log_watchdog_s,
        max_runtime_s=job.max_runtime_s,
        stop_grace_s=settings.agent.stop_grace_s,
    )


def assignments_for(session: Session, node: Node, settings: Settings) -> list[Assignment]:
    allocs = list(
        session.scalars(
            select(JobAllocation)
            .where(JobAllocation.node_name == node.name, JobAllocation.active.is_(True))
            .order_by(JobAllocation.job_id, JobAllocation.attempt)
        )
    )
    out = []
    for alloc in allocs:
        job = alloc.job
        out.append(
            Assignment(job_id=job.id, attempt=alloc.attempt, action=_action(job, alloc), spec=_launch_spec(job, alloc, settings))  # type: ignore[arg-type]
        )
    return out


def digest(assignments: list[Assignment]) -> str:
    payload = json.dumps([a.model_dump(mode="json") for a in assignments], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _reply(session: Session, node: Node, settings: Settings) -> ServerReply:
    assignments = assignments_for(session, node, settings)
    return ServerReply(
        node=node.name,
        assignments=assignments,
        assignments_digest=digest(assignments),
        heartbeat_interval_s=settings.agent.heartbeat_interval_s,
    )


# -- reconciliation ------------------------------------------------------------------------
def _reconcile(
    session: Session,
    node: Node,
    attempts: list[AttemptStatus],
    *,
    agent_digest: str | None,
    now: datetime,
    settings: Settings,
) -> None:
    active = {
        (a.job_id, a.attempt): a
        for a in session.scalars(
            select(JobAllocation).where(JobAllocation.node_name == node.name, JobAllocation.active.is_(True))
        )
    }
    touched: dict[int, Job] = {}
    reported = set()
    for status in attempts:
        key = (status.job_id, status.attempt)
        reported.add(key)
        alloc = active.get(key)
        if alloc is None:
            continue  # not ours any more: the agent stops what it is not assigned
        alloc.status = status.model_dump(mode="json")
        job = alloc.job
        _absorb_reports(job, status)
        if _node_done(job, alloc, status):
            _release(alloc, now)
        touched[job.id] = job
    # Allocations whose stop the agent has seen (its digest is current) and that it does not
    # hold: nothing runs there any more.
    if agent_digest is not None and agent_digest == digest(assignments_for(session, node, settings)):
        for key, alloc in active.items():
            if key not in reported and alloc.active and _action(alloc.job, alloc) == "stop":
                _release(alloc, now)
                touched[alloc.job.id] = alloc.job
    for job in touched.values():
        evaluate_job(session, job, now=now)
    session.flush()


def _absorb_reports(job: Job, status: AttemptStatus) -> None:
    if status.checkpoint is not None:
        cur = job.last_checkpoint or {}
        if cur.get("at") is None or status.checkpoint.at > cur["at"]:
            job.last_checkpoint = status.checkpoint.model_dump(mode="json")
    if status.progress is not None and status.attempt == job.attempt:
        cur = job.progress or {}
        if cur.get("at") is None or status.progress.at >= cur["at"]:
            job.progress = status.progress.model_dump(mode="json")


def _node_done(job: Job, alloc: JobAllocation, status: AttemptStatus) -> bool:
    """Nothing of this attempt runs on this node any more."""
    if any(r.state == "running" for r in status.ranks):
        return False
    return status.finished or status.launch_error is not None or len(status.ranks) >= _expected_ranks(job)


def _release(alloc: JobAllocation, now: datetime) -> None:
    alloc.active = False
    alloc.released_at = now


def evaluate_job(session: Session, job: Job, *, now: datetime) -> None:
    """Derive the job's state from its current attempt's per-node reports."""
    state = JobState(job.state)
    if state.terminal or state == JobState.QUEUED:
        return
    allocs = [a for a in job.allocations if a.attempt == job.attempt]
    statuses = [(a, AttemptStatus.model_validate(a.status)) for a in allocs if a.status]
    expected = _expected_ranks(job)

    for alloc, st in statuses:
        if st.launch_error:
            _fail(session, job, reason=f"could not launch on node {alloc.node_name}: {st.launch_error}", now=now)
            return
    if state != JobState.SUSPENDING:
        failure = _first_failure(statuses)
        if failure is not None:
            reason, code = failure
            _fail(session, job, reason=reason, now=now, exit_code=code)
            return

    complete = len(statuses) == len(allocs) and all(len(st.ranks) >= expected for _, st in statuses)
    all_exited = complete and all(r.state == "exited" for _, st in statuses for r in st.ranks)
    if state == JobState.SUSPENDING:
        all_done = len(statuses) == len(allocs) and all(
            st.finished or (len(st.ranks) >= expected and all(r.state == "exited" for r in st.ranks))
            for _, st in statuses
        )
        if not all_done:
            return
        never_ran = all(st.stop_cause == "not_launched" for _, st in statuses)
        ready = never_ran or any(st.suspend_ready for _, st in statuses)
        forced = [st.stopped_reason or st.stop_cause for _, st in statuses if st.stopped_reason or st.stop_cause]
        if ready or forced:
            _suspended(session, job, ready=ready, forced_reason=forced[0] if forced else None, now=now)
        elif all(r.exit_code == 0 for _, st in statuses for r in st.ranks):
            _succeed(session, job, now=now)
        else:
            codes = [r.exit_code for _, st in statuses for r in st.ranks if r.exit_code not in (0, None)]
            _fail(session, job, reason="exited while suspending without reaching a checkpoint", now=now,
                  exit_code=codes[0] if codes else None)
        return
    if all_exited:
        _succeed(session, job, now=now)
        return
    if state == JobState.STARTING and complete:
        transition(session, job, JobState.RUNNING, reason="all ranks started", now=now)


# causes of an agent-side stop that are the job's own failure
_FAILING_STOPS = ("max_runtime", "log_watchdog")


def _first_failure(statuses: list[tuple[JobAllocation, AttemptStatus]]) -> tuple[str, int | None] | None:
    """Why the attempt failed, if it did: a limit the agent enforced, else the rank that exited
    with its own non-zero code (before ranks that were merely signalled to stop)."""
    for alloc, st in sorted(statuses, key=lambda p: p[0].node_rank):
        if st.stop_cause in _FAILING_STOPS or (st.stopped_reason and st.stop_cause is None):
            return f"stopped on node {alloc.node_name}: {st.stopped_reason or st.stop_cause}", None
    bad = [
        (alloc, rank)
        for alloc, st in statuses
        for rank in st.ranks
        if rank.state == "exited" and rank.exit_code not in (0, None)
    ]
    if not bad:
        return None
    alloc, rank = min(bad, key=lambda p: (p[1].exit_code < 0, p[0].node_rank, p[1].rank))  # type: ignore[operator]
    return f"rank {rank.rank} on node {alloc.node_name} exited with code {rank.exit_code}", rank.exit_code


def _succeed(session: Session, job: Job, *, now: datetime) -> None:
    job.exit_code = 0
    transition(session, job, JobState.SUCCEEDED, reason="every rank exited 0", now=now)


def _fail(session: Session, job: Job, *, reason: str, now: datetime, exit_code: int | None = None) -> None:
    job.exit_code = exit_code
    job.failure_reason = reason
    transition(session, job, JobState.FAILED, reason=reason, now=now)


def _suspended(session: Session, job: Job, *, ready: bool, forced_reason: str | None, now: datetime) -> None:
    gpus = job.nodes * job.gpus_per_node
    ckpt = job.last_checkpoint or {}
    attempt_start = job.attempt_started_at.timestamp() if job.attempt_started_at else now.timestamp()
    if ready:
        reason = "suspended at its checkpoint"
        if ckpt.get("step") is not None:
            reason += f" (step {ckpt['step']})"
    else:
        safe_at = max(ckpt.get("at") or 0.0, attempt_start)
        lost = max(0.0, now.timestamp() - safe_at) * gpus
        job.lost_gpu_s += lost
        reason = f"stopped without a checkpoint ({forced_reason}); {lost:.0f} GPU-seconds of work lost"
    job.suspensions += 1
    transition(session, job, JobState.QUEUED, reason=reason, now=now)
    if job.user_suspended:
        job.pending_reason = "suspended by its owner; resume it to queue it again"
    else:
        job.pending_reason = "suspended; waiting to resume"


# -- the reaper ----------------------------------------------------------------------------
def mark_lost_nodes(*, session: Session, settings: Settings, now: datetime | None = None) -> list[str]:
    """Nodes silent for longer than agent.lost_after_s become ``lost``; their GPUs are given up
    and the jobs that ran there go back to the queue (a restart, not a suspension)."""
    now = now or utcnow()
    cutoff = now - timedelta(seconds=settings.agent.lost_after_s)
    lost = list(
        session.scalars(
            select(Node).where(Node.state != "lost", Node.last_heartbeat_at.is_not(None), Node.last_heartbeat_at < cutoff)
            .with_for_update()
        )
    )
    for node in lost:
        node.state = "lost"
        node.state_reason = f"no heartbeat since {node.last_heartbeat_at.isoformat()}"
        allocs = list(
            session.scalars(
                select(JobAllocation).where(JobAllocation.node_name == node.name, JobAllocation.active.is_(True))
            )
        )
        for alloc in allocs:
            _release(alloc, now)
            job = alloc.job
            if alloc.attempt == job.attempt and JobState(job.state) in ACTIVE_STATES:
                job.restarts += 1
                transition(session, job, JobState.QUEUED, reason=f"node {node.name} was lost; requeued", now=now)
                job.pending_reason = f"requeued after node {node.name} was lost"
    if lost:
        publish_after_commit(session, notify.SCHEDULER)
    session.commit()
    return [n.name for n in lost]
