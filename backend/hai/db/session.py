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

        # SQLite: take the write lock at BEGIN so two writers queue instead of failing on upgrade
        @event.listens_for(engine, "begin")
        def _begin_immediate(conn):  # noqa: ANN001
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        @event.listens_for(engine, "connect")
        def _no_pysqlite_begin(dbapi_conn, _record):  # noqa: ANN001
            dbapi_conn.isolation_level = None

        return engine
    return create_engine(url, echo=echo, pool_size=20, max_overflow=20, pool_pre_ping=True)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
