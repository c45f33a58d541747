"""ORM -> response model conversions shared by the routes."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from hai.db.models import Job, Node
from hai.schemas.jobs import JobEventRead, JobRead, PlacementRead
from hai.services.jobs import placement_of


def node_labels(session: Session) -> dict[str, tuple[str, str]]:
    return {name: (zone, leaf) for name, zone, leaf in session.execute(select(Node.name, Node.zone, Node.leaf))}


def job_read(job: Job, labels: dict[str, tuple[str, str]]) -> JobRead:
    return JobRead(
        id=job.id,
        name=job.name,
        user=job.user_name,
        group=job.group,
        state=job.state,
        priority=job.priority,
        submitted_priority=job.submitted_priority,
        nodes=job.nodes,
        gpus_per_node=job.gpus_per_node,
        job_type=job.job_type,
        command=job.command,
        env=job.env or {},
        tags=job.tags or [],
        allow_cross_zone=job.allow_cross_zone,
        max_runtime_s=job.max_runtime_s,
        suspend_grace_s=job.suspend_grace_s,
        log_watchdog_s=job.log_watchdog_s,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        exit_code=job.exit_code,
        failure_reason=job.failure_reason,
        attempt=job.attempt,
        suspensions=job.suspensions,
        restarts=job.restarts,
        held=job.user_suspended,
        placement=[
            PlacementRead(
                node=a.node_name,
                zone=labels.get(a.node_name, ("?", "?"))[0],
                leaf=labels.get(a.node_name, ("?", "?"))[1],
                gpus=a.gpus,
            )
            for a in placement_of(job)
        ],
        placement_reason=job.placement_reason,
        pending_reason=job.pending_reason,
        last_checkpoint=job.last_checkpoint,
        progress=job.progress,
        lost_gpu_s=job.lost_gpu_s,
        events=[JobEventRead.model_validate(e) for e in job.events],
    )
