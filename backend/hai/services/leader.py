"""One scheduler decides at a time. PostgreSQL: a session advisory lock held on a dedicated
connection (released by the database if the process dies). SQLite: an exclusive file lock next
to the database (the embedded mode runs on one machine)."""

from __future__ import annotations

import fcntl
import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sqlalchemy import text

from hai.services.context import Platform

log = logging.getLogger(__name__)


class NotLeader(Exception):
    pass


@contextmanager
def leadership(platform: Platform, *, stop: threading.Event, poll_s: float = 1.0) -> Iterator[None]:
    """Block until this process leads (or ``stop`` is set: raises NotLeader), hold it inside."""
    engine = platform.engine
    if engine.dialect.name == "postgresql":
        key = platform.settings.scheduler.lock_id
        with engine.connect() as conn:
            announced = False
            while not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar():
                conn.commit()
                if not announced:
                    log.info("another scheduler leads; waiting for the lock")
                    announced = True
                if stop.wait(poll_s):
                    raise NotLeader("stopped while waiting for leadership")
            conn.commit()
            log.info("scheduler: leading")
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
        return
    path = Path(platform.settings.data_dir) / "scheduler.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        announced = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not announced:
                    log.info("another scheduler leads; waiting for the lock")
                    announced = True
                if stop.wait(poll_s):
                    raise NotLeader("stopped while waiting for leadership") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
