"""Engine and session factory. Built on demand from settings, never at import time."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str, *, echo: bool = False) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            echo=echo,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=20,
            max_overflow=40,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        # SQLite: a writing transaction takes the write lock at BEGIN, so two writers queue instead
        # of failing on upgrade; a read-only one (sessions of ``read_only(engine)``: GET requests,
        # token look-ups) begins deferred and, with WAL, reads its snapshot beside the writer
        # instead of queueing behind a scheduling cycle (issue 12)
        @event.listens_for(engine, "begin")
        def _begin(conn):  # noqa: ANN001
            conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")

        @event.listens_for(engine, "connect")
        def _no_pysqlite_begin(dbapi_conn, _record):  # noqa: ANN001
            dbapi_conn.isolation_level = None

        return engine
    return create_engine(url, echo=echo, pool_size=20, max_overflow=20, pool_pre_ping=True)


READ_ONLY = "hai_read_only"


def read_only(engine: Engine) -> Engine:
    """The same engine (and pool) for transactions that only read: deferred BEGIN on SQLite,
    no difference on PostgreSQL."""
    return engine.execution_options(**{READ_ONLY: True})


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
