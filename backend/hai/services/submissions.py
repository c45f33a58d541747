"""Submitting a job through the API (issue 13): the per-user queue limit and the
``Idempotency-Key`` replay, around ``jobs.submit_admitted`` (which writes the key in the job's own
transaction, so a crash between the commit and the response loses nothing; on PostgreSQL the
checks and the writes are one statement, issue 12)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hai.db.models import Job
from hai.db.session import LoopStatements, on_loop
from hai.schemas.jobs import JobBatchCreate, JobCreate, JobRead
from hai.services import jobs as job_service
from hai.services import notify
from hai.services.auth import Principal
from hai.services.errors import Forbidden, Invalid, TooMany
from hai.services.faults import crash_point
from hai.services.job_views import job_read, job_reads, submitted_read
from hai.services.notify import Notifier
from hai.settings import LimitsSettings


@dataclass(frozen=True)
class Submitted:
    job: JobRead
    replayed: bool  # True: the key was seen before; this is the job it created


def request_hash(spec: JobCreate) -> str:
    """The normalised body (defaults filled in, keys sorted): equal specs hash equal."""
    body = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def _with_hash(spec: JobCreate, key: str | None) -> tuple[str, str] | None:
    """(key, the body's hash) for a submission with an Idempotency-Key, else None: the normalised
    body's hash only matters with a key (a JSON dump and a SHA-256 otherwise wasted)."""
    return (key, request_hash(spec)) if key is not None else None


def _replayed(session: Session, *, seen: job_service.KeySeen, digest: str) -> Submitted:
    """The key was used before: its job if the body is the same, else 422 (nothing written)."""
    if seen.request_hash != digest:
        raise Invalid(
            "Idempotency-Key",
            f"this Idempotency-Key was used with another request body (job {seen.job_id}); use a new key for a new job",
        )
    job = session.get(Job, seen.job_id)
    assert job is not None  # the key row cascades with its job
    return Submitted(job=job_read(session=session, job=job), replayed=True)


def submit(
    *, session: Session, spec: JobCreate, user: Principal, limits: LimitsSettings, idempotency_key: str | None = None
) -> Submitted:
    return _submit(session=session, spec=spec, user=user, limits=limits, idempotency_key=idempotency_key, commit=True)


def _submit(
    *, session: Session, spec: JobCreate, user: Principal, limits: LimitsSettings, idempotency_key: str | None,
    commit: bool,
) -> Submitted:
    """``submit``; ``commit=False``: in the caller's begun transaction, neither committed nor rolled
    back here (a refusal writes nothing of this job), an IntegrityError raised on."""
    job_service.check_submitter(user)
    idem = _with_hash(spec, idempotency_key)
    digest = idem[1] if idem is not None else ""
    try:
        # the key's earlier use, the cluster fit (422) and the user's queued-jobs limit (429), then
        # the job, its event and its key, committed: one statement on PostgreSQL (issue 12)
        row = job_service.submit_admitted(session=session, spec=spec, user=user,
                                          limit=limits.max_queued_jobs_per_user, idempotency=idem, commit=commit)
    except IntegrityError:
        if not commit:
            raise
        # the same key committed by a concurrent request in between: answer with its job
        session.rollback()
        if idempotency_key is None:
            raise
        seen = session.execute(job_service.SEEN_KEY, {"user_id": user.user_id, "key": idempotency_key}).one_or_none()
        if seen is None:
            raise
        row = job_service.KeySeen(job_id=seen.job_id, request_hash=seen.request_hash)
    if isinstance(row, job_service.KeySeen):
        return _replayed(session, seen=row, digest=digest)
    if commit:
        crash_point("after_submit_commit")
    return Submitted(job=submitted_read(row), replayed=False)


# what a submission of a group may be answered with alone: refused before it wrote anything
REFUSALS = (Invalid, TooMany, Forbidden)
Single = tuple[JobCreate, Principal, "str | None"]  # (spec, user, Idempotency-Key)


def submit_group(
    *, sessions: Callable[[], Session], items: Sequence[Single], limits: LimitsSettings,
) -> list[Submitted | Exception]:
    """Single submissions that arrived together (issue 12: a CI's burst, several requests in
    flight), in the order given, written in one transaction: what each would get alone, one after
    another (the same checks, each seeing the jobs and keys of those before it; a refusal is that
    submission's answer and writes nothing of it), at one BEGIN, one COMMIT and one write lock for
    all of them. A failure of the group itself (the database away) is raised for all of them:
    nothing of the group is written. A key committed by another process in between (an
    IntegrityError on PostgreSQL) rolls the group back, and each is then submitted alone, as
    ``submit`` answers that race. A group of one is a single submission (on PostgreSQL one
    statement in autocommit: no BEGIN and COMMIT round trips)."""
    if len(items) == 1:
        return [_alone(sessions, items[0], limits)]
    try:
        with sessions() as session:
            session.connection()  # the group's one transaction (PostgreSQL: not the single's autocommit)
            out: list[Submitted | Exception] = []
            for spec, user, key in items:
                try:
                    out.append(_submit(session=session, spec=spec, user=user, limits=limits, idempotency_key=key,
                                       commit=False))
                except REFUSALS as exc:
                    out.append(exc)
            session.commit()
    except IntegrityError:
        return [_alone(sessions, item, limits) for item in items]
    crash_point("after_submit_commit")
    return out


def _alone(sessions: Callable[[], Session], item: Single, limits: LimitsSettings) -> Submitted | Exception:
    """One submission of a group written alone: its answer, or what it raised (the others' stand)."""
    spec, user, key = item
    try:
        with sessions() as session:
            return submit(session=session, spec=spec, user=user, limits=limits, idempotency_key=key)
    except Exception as exc:  # noqa: BLE001 - this submission's answer (a refusal, the database away)
        return exc


async def submit_alone_on(
    statements: LoopStatements, *, sessions: Callable[[], Session], item: Single, limits: LimitsSettings,
    notifier: Notifier,
) -> Submitted | Exception:
    """PostgreSQL, on the event loop (api/jobs.SubmissionGroups, a group of one): the submission's
    one statement on ``statements``' connection, without a Session (``jobs.submit_admitted_on``);
    a job written is answered from its row and wakes the scheduler. What it did not write (a
    refusal, a key's replay, a key committed meanwhile) is answered by ``submit_group`` on
    ``sessions`` (on this loop, ``hai.db.session.on_loop``), as before: its checks run again and
    say why, or write the job if it fits now. Returns what ``submit_group`` returns for it."""
    spec, user, key = item
    try:
        row = await job_service.submit_admitted_on(
            statements, spec=spec, user=user, limit=limits.max_queued_jobs_per_user,
            idempotency=_with_hash(spec, key))
    except IntegrityError:  # the same key committed by a concurrent request in between
        row = None
    except Exception as exc:  # noqa: BLE001 - this submission's answer (a refusal, the database away)
        return exc
    if row is None:
        return (await on_loop(submit_group, sessions=sessions, items=[item], limits=limits))[0]
    notifier.publish(notify.SCHEDULER)
    crash_point("after_submit_commit")
    return Submitted(job=submitted_read(row), replayed=False)


async def submit_group_on(
    statements: LoopStatements, *, sessions: Callable[[], Session], items: Sequence[Single], limits: LimitsSettings,
    notifier: Notifier,
) -> list[Submitted | Exception]:
    """PostgreSQL, on the event loop (api/jobs.SubmissionGroups, a group of several): the
    submissions' statements in one transaction on ``statements``' connection, pipelined, without a
    Session (``jobs.submit_admitted_group_on``); what ``submit_group`` answers, in the same order.
    A job written is answered from its row; one not written (a refusal, a key's replay: each
    statement sees those before it in the group) is answered afterwards by ``submit_group`` alone
    on ``sessions``, which says why, as ``submit_alone_on`` does. A user who may not submit is
    answered so and left out. A key another request committed meanwhile rolls the group back, and
    each is then submitted alone, as ``submit_group`` answers that race; any other failure of the
    group (the database away) is each one's answer, nothing of the group written."""
    out: list[Submitted | Exception | None] = [None] * len(items)
    sent: list[int] = []
    for i, (_, user, _) in enumerate(items):
        try:
            job_service.check_submitter(user)
        except Forbidden as exc:
            out[i] = exc
        else:
            sent.append(i)
    if not sent:
        return out
    try:
        rows = await job_service.submit_admitted_group_on(
            statements, [(items[i][0], items[i][1], _with_hash(items[i][0], items[i][2])) for i in sent],
            limit=limits.max_queued_jobs_per_user)
    except IntegrityError:  # a key committed by a concurrent request in between: each alone
        rows = [None] * len(sent)
    except Exception as exc:  # noqa: BLE001 - the group's failure: nothing of it written
        return [exc if answer is None else answer for answer in out]
    if any(row is not None for row in rows):
        notifier.publish(notify.SCHEDULER)
        crash_point("after_submit_commit")
    for i, row in zip(sent, rows):
        out[i] = Submitted(job=submitted_read(row), replayed=False) if row is not None else \
            (await on_loop(submit_group, sessions=sessions, items=[items[i]], limits=limits))[0]
    return out


@dataclass(frozen=True)
class SubmittedBatch:
    jobs: list[JobRead]
    replayed: bool  # True: the key was seen before; these are the jobs it created


def batch_hash(batch: JobBatchCreate) -> str:
    """The normalised batch (each job's defaults filled in, keys sorted): equal batches hash equal,
    and never as a single job's body does (the list is wrapped in an object)."""
    body = json.dumps({"jobs": [spec.model_dump(mode="json") for spec in batch.jobs]}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def submit_batch(
    *, session: Session, batch: JobBatchCreate, user: Principal, limits: LimitsSettings,
    idempotency_key: str | None = None,
) -> SubmittedBatch:
    """``POST /api/v1/jobs/batch``: ``jobs.submit_batch`` with the user's queued-jobs limit and the
    ``Idempotency-Key`` replay (the key and the body of the whole batch)."""
    job_service.check_submitter(user)
    digest = batch_hash(batch) if idempotency_key is not None else ""
    idem = (idempotency_key, digest) if idempotency_key is not None else None
    try:
        rows = job_service.submit_batch(session=session, specs=batch.jobs, user=user,
                                        limit=limits.max_queued_jobs_per_user, idempotency=idem)
    except IntegrityError:
        # the same key committed by a concurrent request in between: answer with its jobs
        session.rollback()
        if idempotency_key is None:
            raise
        rows = job_service.seen_batch(session, user_id=user.user_id,
                                      keys=job_service.batch_keys(idempotency_key, len(batch.jobs)))
        if not rows:
            raise
    if rows and isinstance(rows[0], job_service.KeySeen):
        if rows[0].request_hash != digest:
            raise Invalid(
                "Idempotency-Key",
                f"this Idempotency-Key was used with another request body (job {rows[0].job_id}); use a new key "
                "for new jobs",
            )
        found = {job.id: job for job in session.scalars(select(Job).where(Job.id.in_([r.job_id for r in rows])))}
        return SubmittedBatch(jobs=job_reads(session=session, jobs=[found[r.job_id] for r in rows if r.job_id in found]),
                              replayed=True)
    crash_point("after_submit_commit")
    return SubmittedBatch(jobs=[submitted_read(row) for row in rows], replayed=False)
