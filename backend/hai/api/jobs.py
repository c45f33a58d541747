from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Callable

from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.responses import PlainTextResponse
from pydantic import TypeAdapter
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from hai.api.deps import BearerCredentials, CurrentUser, PlatformDep, SessionDep, user_in_thread
from hai.api.early import EarlyAnswer
from hai.domain.jobs import JobState
from hai.schemas.jobs import JobBatchCreate, JobBatchRead, JobCreate, JobList, JobRead
from hai.services import jobs as job_service
from hai.services import logs as log_service
from hai.services import submissions
from hai.services.auth import Principal
from hai.services.context import Platform
from hai.services.job_views import CountMode, job_list_json, job_read, list_jobs as list_job_page

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])


KEY_PATTERN = r"^[\x21-\x7e]+$"  # printable ASCII, no space
KEY_MAX = 255
_KEY = re.compile(KEY_PATTERN)  # the early answer's check of the route's header rules


def _idempotency_key(max_length: int, made: str) -> object:
    """The ``Idempotency-Key`` header of a submission that creates ``made``; a key holds no space
    (a batch's keys of its later jobs do: ``jobs.batch_keys``)."""
    return Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            min_length=1,
            max_length=max_length,
            pattern=KEY_PATTERN,
            description=f"a client-chosen unique key (e.g. a UUID): a retry with the same key and body returns the "
            f"{made} the first request created (200) instead of new ones; the same key with another body is a 422",
        ),
    ]


IdempotencyKeyHeader = _idempotency_key(KEY_MAX, "job")
BatchIdempotencyKeyHeader = _idempotency_key(250, "jobs")  # room for the suffix of its later jobs' keys


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobRead,
    responses={
        200: {"model": JobRead, "description": "a replay: the job this Idempotency-Key created before"},
        429: {"description": "the user's queued-jobs limit is reached"},
    },
)
async def submit(
    spec: JobCreate,
    request: Request,
    response: Response,
    platform: PlatformDep,
    creds: BearerCredentials,
    idempotency_key: IdempotencyKeyHeader = None,
) -> JobRead:
    # issue 12: the token look-up and the submission share one session and one worker thread
    # (CurrentUser + SessionDep would take a connection and a thread hop each)
    done = await run_in_threadpool(_submit, platform, spec, idempotency_key,
                                   lambda session: user_in_thread(request, platform, creds, session))
    if done.replayed:
        response.status_code = status.HTTP_200_OK
    return done.job


def _submit(platform: Platform, spec: JobCreate, idempotency_key: str | None,
            user_of: Callable[[object], Principal]) -> submissions.Submitted:
    """A submission's whole work, in a worker thread: one session, the user from ``user_of(session)``."""
    with platform.sessions() as session:
        return submissions.submit(session=session, spec=spec, user=user_of(session),
                                  limits=platform.settings.limits, idempotency_key=idempotency_key)


_JOB_READ = TypeAdapter(JobRead)


class SubmissionGroups:
    """Group commit of single submissions (issue 12): the submissions this process receives while
    one group is being written wait and are written next, together, in one transaction
    (``submissions.submit_group``: each answered as it would be alone, in arrival order). One
    request in flight is a group of one; eight in flight share BEGIN, COMMIT, the thread hop and
    (SQLite) the write lock, where each took them in turn, eight threads handing the interpreter
    lock and the write lock between them. On PostgreSQL (``db.submit_on_loop``) a group is written
    on the event loop itself, on the connection the loop holds (``Platform.loop_statements``: a
    group of one as its one statement, a group of several as one pipelined transaction of them,
    no Session; what they did not write answered through ``Platform.loop_sessions``), with no
    worker thread at all; on SQLite in a worker thread.
    ``groups`` counts the groups written, ``largest`` the most submissions one held."""

    most = 64  # submissions a group holds at most (one SQLite write lock held ~0.3 ms each)

    def __init__(self) -> None:
        self._waiting: list[tuple[submissions.Single, asyncio.Future]] = []
        self._writer: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the writer's
        self.groups = 0
        self.largest = 0

    async def submit(self, platform: Platform, item: submissions.Single) -> submissions.Submitted:
        """The submission's answer, or its refusal raised (or the group's failure)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # another event loop (a test client's, each its own): the last one's
            self._writer, self._waiting, self._loop = None, [], loop  # writer and waiters went with it
        done = loop.create_future()
        self._waiting.append((item, done))
        if self._writer is None:
            self._writer = loop.create_task(self._write(platform))
        return await done

    @staticmethod
    async def _written(platform: Platform, items: list[submissions.Single]) -> list[submissions.Submitted | Exception]:
        """One group written: on PostgreSQL on this loop (no worker thread, no Session: a group of
        one as its one statement on the loop's statement connection, a group of several as one
        pipelined transaction there), else in a worker thread."""
        on_loop_sessions = platform.loop_sessions()
        if on_loop_sessions is not None:
            if len(items) == 1:
                return [await submissions.submit_alone_on(
                    platform.loop_statements(), sessions=on_loop_sessions, item=items[0],
                    limits=platform.settings.limits, notifier=platform.notifier)]
            return await submissions.submit_group_on(
                platform.loop_statements(), sessions=on_loop_sessions, items=items,
                limits=platform.settings.limits, notifier=platform.notifier)
        return await run_in_threadpool(submissions.submit_group, sessions=platform.sessions, items=items,
                                       limits=platform.settings.limits)

    async def _write(self, platform: Platform) -> None:
        group: list[tuple[submissions.Single, asyncio.Future]] = []
        try:
            while self._waiting:
                group = self._waiting[: self.most]
                del self._waiting[: self.most]
                # a request gone before its group was written (cancelled): not written
                group = [entry for entry in group if not entry[1].done()]
                if not group:
                    continue
                self.groups += 1
                self.largest = max(self.largest, len(group))
                try:
                    outcomes = await self._written(platform, [item for item, _ in group])
                except Exception as exc:  # noqa: BLE001 - the group's failure (nothing written) is each one's answer
                    outcomes = [exc] * len(group)
                for (_, done), outcome in zip(group, outcomes):
                    if done.done():  # (its request went away)
                        continue
                    if isinstance(outcome, Exception):
                        done.set_exception(outcome)
                    else:
                        done.set_result(outcome)
                group = []
        finally:  # (cancelled: the server stopping) no request left waiting on a writer that is gone
            pending, self._waiting = group + self._waiting, []
            for _, done in pending:
                done.cancel()
            self._writer = None


class EarlySubmissions(EarlyAnswer):
    """``POST /api/v1/jobs`` answered before routing (issue 12, ``hai.api.early``): one job a request
    is how a CI, a script and ``hai submit`` submit, and the framework around the route (routing,
    dependencies, the middleware's layers around the request and each ``send``) was a fifth of a
    submission's server instructions (callgrind: 4.14 M -> 3.31 M without it). The same work as
    the route (``submissions.submit``, through ``SubmissionGroups``: those that arrive together are
    written in one transaction) for a user credential already in the token cache, a body that
    validates as a ``JobCreate`` as FastAPI validates it (``json.loads``, then the model) and at
    most one ``Idempotency-Key`` that the route's header rules accept; the same answer: 201 with
    the bytes of the route's response model, 200 for a key's replay; a refusal (422 no fit or a key
    reused with another body, 429 queue full, 503 database away) is the application's exception
    handler's answer. Left to the route: a body or a key that does not validate (the route's 422
    names the field or the header), a credential not cached (the look-up, its failures' throttle)."""

    path = router.prefix

    def __init__(self, app, *, owner) -> None:  # noqa: ANN001
        super().__init__(app, owner=owner)
        self.grouped = SubmissionGroups()

    async def answer(self, request: Request, platform, principal, body: bytes):  # noqa: ANN001, ANN201
        keys = request.headers.getlist("idempotency-key")
        if len(keys) > 1 or (keys and not (len(keys[0]) <= KEY_MAX and _KEY.fullmatch(keys[0]))):
            return None  # the route's 422 on the header
        try:
            spec = JobCreate.model_validate(json.loads(body))
        except Exception:  # noqa: BLE001 - not JSON or not a job: the route's 422 names the field
            return None
        try:
            done = await self.grouped.submit(platform, (spec, principal, keys[0] if keys else None))
        except Exception as exc:  # noqa: BLE001 - refused (nothing written) or the database away
            return await self.handled(request, exc)
        code = status.HTTP_200_OK if done.replayed else status.HTTP_201_CREATED
        return code, _JOB_READ.dump_json(done.job, by_alias=True)


@router.post(
    "/batch",
    status_code=status.HTTP_201_CREATED,
    response_model=JobBatchRead,
    responses={
        200: {"model": JobBatchRead, "description": "a replay: the jobs this Idempotency-Key created before"},
        429: {"description": "the user's queued jobs and this batch would exceed the queued-jobs limit"},
    },
)
async def submit_batch(
    batch: JobBatchCreate,
    request: Request,
    response: Response,
    platform: PlatformDep,
    creds: BearerCredentials,
    idempotency_key: BatchIdempotencyKeyHeader = None,
) -> JobBatchRead:
    """Up to 1,000 jobs in one request, all queued in the order sent, or none (a 422 names the first
    job that cannot be accepted: `jobs.<i>.<field>`); one transaction and one scheduler wake-up
    (issue 12: bursts from CI, sweeps, as Slurm's job arrays)."""
    def work() -> submissions.SubmittedBatch:
        with platform.sessions() as session:
            user = user_in_thread(request, platform, creds, session)
            return submissions.submit_batch(
                session=session, batch=batch, user=user, limits=platform.settings.limits,
                idempotency_key=idempotency_key,
            )

    done = await run_in_threadpool(work)
    if done.replayed:
        response.status_code = status.HTTP_200_OK
    return JobBatchRead(jobs=done.jobs)


@router.get("", response_model=JobList)
def list_jobs(  # noqa: PLR0913
    session: SessionDep,
    viewer: CurrentUser,
    state: Annotated[list[JobState] | None, Query(description="filter by state (repeatable)")] = None,
    user: Annotated[str | None, Query(description="filter by user name")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
    before_id: Annotated[
        int | None,
        Query(ge=1, description="keyset paging: only jobs with a lower id (the last id of the previous page)"),
    ] = None,
    count: Annotated[
        CountMode,
        Query(description="`auto`: `total` exact up to 10,000 matching jobs, beyond that a lower bound "
              "(`total_exact` false); `exact`: always exact (reads every matching index entry)"),
    ] = CountMode.AUTO,
) -> Response:
    """Jobs, newest first, 50 a page by default (issue 12: column rows, three queries and a bounded count)."""
    page = list_job_page(session=session, state=state or (), user_name=user, limit=limit, offset=offset,
                         before_id=before_id, count=count)
    # serialised by pydantic-core directly (no second validation, no json.dumps of the page)
    return Response(job_list_json(session=session, page=page, viewer=viewer),
                    media_type="application/json")


# ``:int``: /api/v1/jobs/batch is not a job id (a GET there is a 405, not a 422 of this route)
@router.get("/{job_id:int}", response_model=JobRead)
def get_job(job_id: int, session: SessionDep, user: CurrentUser) -> JobRead:
    return job_read(session=session, job=job_service.get_job(session=session, job_id=job_id, user=user))


@router.post("/{job_id}/cancel", response_model=JobRead)
def cancel(job_id: int, session: SessionDep, user: CurrentUser) -> JobRead:
    return job_read(session=session, job=job_service.cancel_job(session=session, job_id=job_id, user=user))


@router.post("/{job_id}/suspend", response_model=JobRead)
def suspend(job_id: int, session: SessionDep, user: CurrentUser) -> JobRead:
    return job_read(session=session, job=job_service.suspend_job(session=session, job_id=job_id, user=user))


@router.post("/{job_id}/resume", response_model=JobRead)
def resume(job_id: int, session: SessionDep, user: CurrentUser) -> JobRead:
    return job_read(session=session, job=job_service.resume_job(session=session, job_id=job_id, user=user))


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {}, "text/event-stream": {}}}},
)
async def logs(
    job_id: int,
    request: Request,
    platform: PlatformDep,
    user: CurrentUser,
    follow: bool = False,
    # within the columns' range (a larger number is a 422, not a 500 from the driver)
    rank: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    attempt: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
    q: Annotated[str | None, Query(max_length=256, description="only lines containing this text")] = None,
    timestamps: bool = False,
):
    """Plain text, each line prefixed with its rank (and attempt once a job has restarted);
    ``follow=true`` streams server-sent events (``log`` per line, ``end`` with the final state)."""
    query = log_service.LogQuery(job_id=job_id, rank=rank, attempt=attempt, text=q, timestamps=timestamps)
    if not follow:
        text = await run_in_threadpool(lambda: log_service.read_text(platform=platform, user=user, query=query))
        return PlainTextResponse(text)
    events = await log_service.follow(platform=platform, user=user, query=query, is_disconnected=request.is_disconnected,
                                      max_s=platform.settings.limits.max_follow_s)
    return EventSourceResponse(events, ping=15)
