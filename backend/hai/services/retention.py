from __future__ import annotations

from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from hai.db.base import utcnow
from hai.db.models import Job, LogLine
from hai.domain.jobs import TERMINAL_STATES


def prune_finished_job_logs(*, session: Session, older_than: timedelta) -> int:
    """Delete the logs of jobs that ended more than ``older_than`` ago. Idempotent."""
    cutoff = utcnow() - older_than
    old_jobs = select(Job.id).where(Job.state.in_([s.value for s in TERMINAL_STATES]), Job.finished_at < cutoff)
    result = session.execute(delete(LogLine).where(LogLine.job_id.in_(old_jobs)))
    session.commit()
    return int(result.rowcount or 0)
