from __future__ import annotations

from typing import Annotated, AsyncIterator

from fastapi import APIRouter, Query, Request, status
from fastapi.responses import PlainTextResponse
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from hai.api.deps import CurrentUser, PlatformDep, SessionDep
from hai.api.views import job_read, node_labels
from hai.domain.jobs import JobState
from hai.schemas.jobs import JobCreate, JobList, JobRead
from hai.services import jobs as job_service
from hai.services import logs as log_service
from hai.services import notify

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobRead)
def submit(spec: JobCreate, session: SessionDep, user: CurrentUser) -> JobRead:
    job = job_service.submit_job(session=session, spec=spec, user=user)
    return job_read(job, node_labels(session))


@router.get("", response_model=JobList)
def list_jobs(
    session: SessionDep,
    _user: CurrentUser,
    state: Annotated[list[JobState] | None, Query(description="filter by state (repeatable)")] = None,
    user: Annotated[str | None, Query(description="filter by user name")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> JobList:
    items, total = job_service.list_jobs(session=session, state=state or (), user_name=user, limit=limit, offset=offset)
    labels = node_labels(session)
    return JobList(items=[job_read(j, labels) for j in items], total=total)


@router.get("/{job_id}", response_model=JobRead)
def get_job(job_id: int, session: SessionDep, user: CurrentUser) -> JobRead:
    return job_read(job_service.get_job(session=session, job_id=job_id, user=user), node_labels(session))


@router.post("/{job_id}/cancel", response_model=JobRead)
def cancel(job_id: int, session: SessionDep, user: CurrentUser) -> JobRead:
    return job_read(job_service.cancel_job(session=session, job_id=job_id, user=user), node_labels(session))


@router.post("/{job_id}/suspend", response_model=JobRead)
def suspend(job_id: int, session: SessionDep, user: CurrentUser) -> JobRead:
    return job_read(job_service.suspend_job(session=session, job_id=job_id, user=user), node_labels(session))


@router.post("/{job_id}/resume", response_model=JobRead)
def resume(job_id: int, session: SessionDep, user: CurrentUser) -> JobRead:
    return job_read(job_service.resume_job(session=session, job_id=job_id, user=user), node_labels(session))


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
    rank: Annotated[int | None, Query(ge=0)] = None,
    attempt: Annotated[int | None, Query(ge=1)] = None,
    q: Annotated[str | None, Query(max_length=256, description="only lines containing this text")] = None,
    timestamps: bool = False,
):
    """Plain text, each line prefixed with its rank (and attempt once a job has restarted);
    ``follow=true`` streams server-sent events (``log`` per line, ``end`` with the final state)."""

    def _read(after_id: int) -> tuple[list[str], int, str, bool]:
        with platform.sessions() as session:
            job = job_service.get_job(session=session, job_id=job_id, user=user)
            lines = log_service.read_lines(
                session=session, job_id=job_id, after_id=after_id, rank=rank, attempt=attempt, query=q
            )
            with_attempt = job.attempt > 1
            text = [log_service.format_line(ln, with_attempt=with_attempt, timestamps=timestamps) for ln in lines]
            return text, (lines[-1].id if lines else after_id), job.state, len(lines) > 0

    if not follow:
        out: list[str] = []
        cursor = 0
        while True:
            text, cursor, _state, more = await run_in_threadpool(_read, cursor)
            out.extend(text)
            if not more:
                break
        return PlainTextResponse("".join(t + "\n" for t in out))

    first = await run_in_threadpool(_read, 0)  # raises 403/404 before the stream starts
    topic = notify.job_topic(job_id)

    async def stream() -> AsyncIterator[dict]:
        text, cursor, state, _ = first
        while True:
            for t in text:
                yield {"event": "log", "data": t}
            if JobState(state).terminal:
                # drain what arrived after the job ended, then close
                while True:
                    text, cursor, state, more = await run_in_threadpool(_read, cursor)
                    for t in text:
                        yield {"event": "log", "data": t}
                    if not more:
                        break
                yield {"event": "end", "data": state}
                return
            if await request.is_disconnected():
                return
            since = platform.notifier.version(topic)
            text, cursor, state, more = await run_in_threadpool(_read, cursor)
            if not more and not JobState(state).terminal:
                await platform.notifier.wait_async(topic, since, 15.0)

    return EventSourceResponse(stream(), ping=15)
