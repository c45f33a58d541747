"""Job logs: stored per job, attempt and rank on the server; re-sent batches are ignored."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from hai.db.models import Job, LogLine
from hai.protocol import LogBatch
from hai.services import notify
from hai.services.jobs import publish_after_commit


def append_batch(*, session: Session, batch: LogBatch) -> int:
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
            "line": line.line[:16384],
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
