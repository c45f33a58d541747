"""Accounting: GPU-hours per user or group over a period, from what jobs actually held (their
allocations, from placement until the agent released the GPUs), and quotas against use now."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from hai.db.models import Job, JobAllocation, Quota


@dataclass(frozen=True, slots=True)
class UsageRow:
    key: str  # user or group name
    gpu_hours: float
    jobs: int


def gpu_hours(*, session: Session, by: str, since: datetime, until: datetime) -> list[UsageRow]:
    """GPU-hours held within [since, until), per user or group, largest first."""
    if by not in ("user", "group"):
        raise ValueError(by)
    col = Job.user_name if by == "user" else Job.group
    rows = session.execute(
        select(col, JobAllocation.job_id, JobAllocation.gpus, JobAllocation.created_at, JobAllocation.released_at)
        .join(Job, Job.id == JobAllocation.job_id)
        .where(JobAllocation.created_at < until,
               or_(JobAllocation.released_at.is_(None), JobAllocation.released_at > since))
    ).all()
    hours: dict[str, float] = defaultdict(float)
    jobs: dict[str, set[int]] = defaultdict(set)
    for key, job_id, gpus, start, end in rows:
        lo = max(start, since)
        hi = min(end or until, until)
        if hi <= lo:
            continue
        hours[key] += len(gpus or ()) * (hi - lo).total_seconds() / 3600.0
        jobs[key].add(job_id)
    return sorted((UsageRow(key=k, gpu_hours=h, jobs=len(jobs[k])) for k, h in hours.items()),
                  key=lambda r: (-r.gpu_hours, r.key))


@dataclass(frozen=True, slots=True)
class QuotaUse:
    group: str
    priority: str
    user: str | None
    gpus: int
    used_gpus: int


def quota_use(*, session: Session) -> list[QuotaUse]:
    """Each quota and the GPUs its jobs hold now."""
    held: dict[tuple[str, str, str], int] = defaultdict(int)
    for group, priority, user, gpus in session.execute(
        select(Job.group, Job.priority, Job.user_name, JobAllocation.gpus)
        .join(Job, Job.id == JobAllocation.job_id)
        .where(JobAllocation.active)
    ):
        held[(group, priority, user)] += len(gpus or ())
    out = []
    for q in session.scalars(select(Quota).order_by(Quota.group, Quota.priority, Quota.user_name)):
        used = sum(v for (g, p, u), v in held.items() if g == q.group and p == q.priority and (q.user_name is None or u == q.user_name))
        out.append(QuotaUse(group=q.group, priority=q.priority, user=q.user_name, gpus=q.gpus, used_gpus=used))
    return out
