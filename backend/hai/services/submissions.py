"""Submitting a job through the API (issue 13): the per-user queue limit and the
``Idempotency-Key`` replay, around ``jobs.submit_job`` (which writes the key in the job's own
transaction, so a crash between the commit and the response loses nothing)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hai.db.models import IdempotencyKey, Job
from hai.schemas.jobs import JobCreate, JobRead
from hai.services import jobs as job_service
from hai.services.auth import Principal
from hai.services.errors import Forbidden, Invalid, TooMany
from hai.services.faults import crash_point
from hai.services.job_views import job_read, submitted_read
from hai.settings import LimitsSettings


@dataclass(frozen=True)
class Submitted:
    job: JobRead
    replayed: bool  # True: the key was seen before; this is the job it created


def request_hash(spec: JobCreate) -> str:
    """The normalised body (defaults filled in, keys sorted): equal specs hash equal."""
    body = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def _replay(session: Session, *, user: Principal, key: str, digest: str) -> Job | None:
    row = session.scalar(select(IdempotencyKey).where(IdempotencyKey.user_id == user.user_id, IdempotencyKey.key == key))
    if row is None:
        return None
    if row.request_hash != digest:
        raise Invalid(
            "Idempotency-Key",
            f"this Idempotency-Key was used with another request body (job {row.job_id}); use a new key for a new job",
        )
    job = session.get(Job, row.job_id)
    assert job is not None  # the key row cascades with its job
    return job


def check_admission(session: Session, *, spec: JobCreate, user: Principal, limits: LimitsSettings) -> None:
    """The cluster can ever fit the job (422), and the user is under the queued-jobs limit (429):
    one query for both (issue 12)."""
    limit = limits.max_queued_jobs_per_user
    queued = job_service.admission_counts(session, spec, user_id=user.user_id, count_queued=bool(limit))
    if limit and queued is not None and queued >= limit:
        raise TooMany(
            f"you have {queued} queued job(s), the most a user may have (HAI_LIMITS__MAX_QUEUED_JOBS_PER_USER="
            f"{limit}); wait for some to start or cancel some"
        )


def submit(
    *, session: Session, spec: JobCreate, user: Principal, limits: LimitsSettings, idempotency_key: str | None = None
) -> Submitted:
    if user.kind != "user" or user.user_id is None:
        raise Forbidden("only users can submit jobs")
    digest = request_hash(spec)
    if idempotency_key is not None:
        job = _replay(session, user=user, key=idempotency_key, digest=digest)
        if job is not None:
            return Submitted(job=job_read(session=session, job=job), replayed=True)
    check_admission(session, spec=spec, user=user, limits=limits)
    idem = (idempotency_key, digest) if idempotency_key is not None else None
    try:
        row = job_service.submit_job(session=session, spec=spec, user=user, idempotency=idem, checked=True)
    except IntegrityError:
        # the same key committed by a concurrent request in between: answer with its job
        session.rollback()
        if idempotency_key is None:
            raise
        job = _replay(session, user=user, key=idempotency_key, digest=digest)
        if job is None:
            raise
        return Submitted(job=job_read(session=session, job=job), replayed=True)
    crash_point("after_submit_commit")
    return Submitted(job=submitted_read(row), replayed=False)
