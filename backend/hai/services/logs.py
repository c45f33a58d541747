"""Job logs: stored per job, attempt and rank on the server; re-sent batches are ignored; read
whole (``read_text``) or followed as server-sent events (``follow``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
import time
from datetime import datetime, timezone

import anyio.to_thread
from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from hai.db.models import Job, LogLine
from hai.domain.jobs import JobState
from hai.protocol import LogBatch
from hai.protocol.messages import replace_nul
from hai.services import notify
from hai.services.auth import Principal
from hai.services.context import Platform
from hai.services.jobs import get_job, publish_after_commit

FOLLOW_WAIT_S = 15.0  # a followed log re-reads at least this often without a notification


TRUNCATED = "[hai: line truncated, {n} more characters]"


def clip(line: str, max_chars: int) -> str:
    """A line over ``max_chars`` keeps its first ``max_chars`` characters and says how much was
    cut (HAI_LIMITS__MAX_LOG_LINE_CHARS), so a reader sees that the line goes on. A NUL character
    (a job that prints binary) is stored as U+FFFD, as the agent stores bytes that are not UTF-8:
    PostgreSQL's text holds no NUL, and psycopg's refusal failed the node's whole batch (a 500 the
    agent retried, every job's lines of that node held behind it)."""
    line = replace_nul(line)
    if len(line) <= max_chars:
        return line
    return line[:max_chars] + " " + TRUNCATED.format(n=len(line) - max_chars)


def append_batch(*, session: Session, batch: LogBatch, max_line_chars: int = 16 * 1024) -> int:
    if not batch.lines:
        return 0
    job_ids = sorted({line.job_id for line in batch.lines})
    known = set(session.scalars(select(Job.id).where(Job.id.in_(job_ids))))
    rows = [
        {
            "job_id": line.job_id,
            "attempt": line.attempt,
            "rank": line.rank,
            "seq": line.seq,
            "ts": line.ts,
            "stream": line.stream,
            "line": clip(line.line, max_line_chars),
        }
        for line in batch.lines
        if line.job_id in known
    ]
    if rows:
        dialect = session.get_bind().dialect.name
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        stmt = insert(LogLine).values(rows).on_conflict_do_nothing(
            index_elements=["job_id", "attempt", "rank", "seq"]
        )
        session.execute(stmt)
        publish_after_commit(session, *(notify.job_topic(j) for j in sorted(known)))
    session.commit()
    return len(rows)


def read_lines(
    *,
    session: Session,
    job_id: int,
    after_id: int = 0,
    rank: int | None = None,
    attempt: int | None = None,
    query: str | None = None,
    limit: int = 10000,
) -> list[LogLine]:
    stmt = select(LogLine).where(LogLine.job_id == job_id, LogLine.id > after_id)
    if rank is not None:
        stmt = stmt.where(LogLine.rank == rank)
    if attempt is not None:
        stmt = stmt.where(LogLine.attempt == attempt)
    if query:
        escaped = query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        stmt = stmt.where(LogLine.line.ilike(f"%{escaped}%", escape="\\"))
    return list(session.scalars(stmt.order_by(LogLine.id).limit(limit)))


def format_line(line: LogLine, *, with_attempt: bool, timestamps: bool) -> str:
    prefix = f"[attempt {line.attempt} rank {line.rank}]" if with_attempt else f"[rank {line.rank}]"
    if timestamps:
        ts = datetime.fromtimestamp(line.ts, tz=timezone.utc).isoformat(timespec="milliseconds")
        prefix = f"{ts} {prefix}"
    return f"{prefix} {line.line}"


# -- reading a job's log, whole or followed -------------------------------------------------
@dataclass(frozen=True)
class LogQuery:
    """Which lines of a job's log, and how they are printed."""

    job_id: int
    rank: int | None = None
    attempt: int | None = None
    text: str | None = None  # only lines containing this
    timestamps: bool = False


@dataclass(frozen=True)
class LogPage:
    lines: list[str]  # formatted
    cursor: int  # the id of the last line read (the next page starts after it)
    state: JobState  # the job's state when the page was read
    more: bool  # the page had lines (there may be more after the cursor)


def read_page(*, session: Session, user: Principal, query: LogQuery, after_id: int = 0) -> LogPage:
    """One page of lines after ``after_id``; raises NotFound/Forbidden like get_job."""
    job = get_job(session=session, job_id=query.job_id, user=user)
    lines = read_lines(session=session, job_id=query.job_id, after_id=after_id, rank=query.rank,
                       attempt=query.attempt, query=query.text)
    with_attempt = job.attempt > 1
    text = [format_line(ln, with_attempt=with_attempt, timestamps=query.timestamps) for ln in lines]
    return LogPage(lines=text, cursor=lines[-1].id if lines else after_id, state=JobState(job.state),
                   more=len(lines) > 0)


def read_text(*, platform: Platform, user: Principal, query: LogQuery) -> str:
    """The whole log as plain text, one line per line."""
    out: list[str] = []
    cursor = 0
    while True:
        with platform.sessions() as session:
            page = read_page(session=session, user=user, query=query, after_id=cursor)
        out.extend(page.lines)
        cursor = page.cursor
        if not page.more:
            return "".join(t + "\n" for t in out)


async def follow(
    *,
    platform: Platform,
    user: Principal,
    query: LogQuery,
    is_disconnected: Callable[[], Awaitable[bool]],
    wait_s: float = FOLLOW_WAIT_S,
    max_s: float = 0.0,
) -> AsyncIterator[dict[str, str]]:
    """Server-sent events for a followed log: ``log`` per line, then ``end`` with the final state
    once the job is terminal (after draining what arrived after it ended). Reads the first page
    before returning, so a missing job or a forbidden one raises before the stream starts. Each
    page is read in a worker thread with its own session; between pages the stream waits for
    the job's log topic (or ``wait_s``). ``max_s`` > 0 (HAI_LIMITS__MAX_FOLLOW_S): a stream
    still open after that long ends with a ``limit`` event (the client follows again)."""
    topic = notify.job_topic(query.job_id)

    def page(after_id: int) -> LogPage:
        with platform.sessions() as session:
            return read_page(session=session, user=user, query=query, after_id=after_id)

    first = await anyio.to_thread.run_sync(page, 0)

    deadline = time.monotonic() + max_s if max_s > 0 else None

    async def stream() -> AsyncIterator[dict[str, str]]:
        p = first
        while True:
            for t in p.lines:
                yield {"event": "log", "data": t}
            if p.state.terminal:
                while True:  # drain what arrived after the job ended, then close
                    p = await anyio.to_thread.run_sync(page, p.cursor)
                    for t in p.lines:
                        yield {"event": "log", "data": t}
                    if not p.more:
                        break
                yield {"event": "end", "data": p.state.value}
                return
            if await is_disconnected():
                return
            since = platform.notifier.version(topic)
            p = await anyio.to_thread.run_sync(page, p.cursor)
            if not p.more and not p.state.terminal:
                # without Redis the lines may arrive through another replica: re-read soon
                left = wait_s if deadline is None else min(wait_s, deadline - time.monotonic())
                if left <= 0:
                    yield {"event": "limit", "data": f"followed for {max_s:g} s (HAI_LIMITS__MAX_FOLLOW_S); follow again"}
                    return
                if platform.notifier.released:
                    yield {"event": "limit", "data": "the server is stopping; follow again"}
                    return
                await platform.notifier.wait_async(topic, since, platform.notifier.bounded(left))

    return stream()
