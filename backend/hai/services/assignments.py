"""What each node should run: the launch spec of every active allocation and the action the
server wants for it (``DesiredAction``), the node's full assignment list and its digest.

One list per reply: the heartbeat loads the node's active allocations once, applies the
agent's report to them, and builds the list once from those still active (``assigned``); see
``services.agents``.
"""

from __future__ import annotations

import hashlib
import json

from sqlalchemy import select
from sqlalchemy.orm import Session, joinedload, lazyload

from hai.db.models import Job, JobAllocation
from hai.domain.jobs import JobState, assignment_action
from hai.protocol import Assignment, DesiredAction, LaunchSpec
from hai.settings import Settings


def action_for(job: Job, alloc: JobAllocation) -> DesiredAction:
    return assignment_action(JobState(job.state), job.desired_action, current_attempt=alloc.attempt == job.attempt)


def expected_ranks(job: Job) -> int:
    """Ranks each node of the job runs."""
    return 1 if job.job_type == "command" else job.gpus_per_node


def launch_spec(job: Job, alloc: JobAllocation, settings: Settings) -> LaunchSpec:
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


def active_allocations(session: Session, node_name: str, *, fresh: bool = False) -> list[JobAllocation]:
    """The allocations that hold GPUs on the node now, in (job, attempt) order, with their jobs
    (one query per heartbeat, not a few per allocation). A job's events and its other
    allocations are not loaded here: a heartbeat that changes nothing needs neither (they load
    on first use, when a report is judged or a transition recorded). ``fresh``: objects already
    in the session are overwritten with the rows as read (the reaper, after it locked the jobs)."""
    stmt = (
        select(JobAllocation)
        .where(JobAllocation.node_name == node_name, JobAllocation.active)
        .order_by(JobAllocation.job_id, JobAllocation.attempt)
        .options(joinedload(JobAllocation.job, innerjoin=True).options(lazyload(Job.events), lazyload(Job.allocations)))
    )
    if fresh:
        stmt = stmt.execution_options(populate_existing=True)
    return list(session.scalars(stmt))


def active_allocations_of(session: Session, node_names: list[str]) -> dict[str, list[JobAllocation]]:
    """``active_allocations`` of several nodes in one query, by node (a batch of heartbeats)."""
    out: dict[str, list[JobAllocation]] = {name: [] for name in node_names}
    if node_names:
        for alloc in session.scalars(
            select(JobAllocation)
            .where(JobAllocation.node_name.in_(sorted(set(node_names))), JobAllocation.active)
            .order_by(JobAllocation.node_name, JobAllocation.job_id, JobAllocation.attempt)
            .options(joinedload(JobAllocation.job, innerjoin=True).options(lazyload(Job.events), lazyload(Job.allocations)))
        ):
            out[alloc.node_name].append(alloc)
    return out


def assignment_of(alloc: JobAllocation, settings: Settings) -> Assignment:
    job = alloc.job
    return Assignment(job_id=job.id, attempt=alloc.attempt, action=action_for(job, alloc),
                      spec=launch_spec(job, alloc, settings))


def assigned(allocs: list[JobAllocation], settings: Settings) -> list[tuple[JobAllocation, Assignment]]:
    """Each of ``allocs`` still active, with its assignment (order kept)."""
    return [(a, assignment_of(a, settings)) for a in allocs if a.active]


def assignments_for(session: Session, node_name: str, settings: Settings) -> list[Assignment]:
    return [a for _, a in assigned(active_allocations(session, node_name), settings)]


def digest(assignments: list[Assignment]) -> str:
    payload = json.dumps([a.model_dump(mode="json") for a in assignments], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
