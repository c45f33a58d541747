"""Engine and session factory. Built on demand from settings, never at import time."""

from __future__ import annotations

import time

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError
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
    # LIFO: a server hands out its most recently used connections (not pinged, see below) and
    # leaves the rest idle, rather than cycling every request through the whole pool
    engine = create_engine(url, echo=echo, pool_size=20, max_overflow=20, pool_use_lifo=True)
    _ping_idle_connections(engine)
    return engine


# a pooled connection used this recently is handed out without a ping (issue 12: the ping was a
# round trip in every request); one idle longer is pinged first, as pool_pre_ping does
PING_AFTER_IDLE_S = 1.0
_CHECKED_IN = "hai_checked_in"


def _ping_idle_connections(engine: Engine) -> None:
    """Pessimistic disconnect handling for idle connections only (SQLAlchemy's documented
    checkout-event recipe): a connection that sat in the pool for PING_AFTER_IDLE_S or longer is
    pinged on checkout and, if dead, replaced (the pool retries the checkout). A busy server's
    connections are not pinged; if the database went away under one anyway, the statement fails
    as a disconnect, SQLAlchemy invalidates the pool, the API answers 503 (api/errors.py) and the
    next request gets a fresh connection."""

    @event.listens_for(engine, "checkin")
    def _checkin(_dbapi_conn, record):  # noqa: ANN001
        record.info[_CHECKED_IN] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn, record, _proxy):  # noqa: ANN001
        since = record.info.get(_CHECKED_IN)
        if since is not None and time.monotonic() - since < PING_AFTER_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as exc:
            raise DisconnectionError(f"a pooled connection is dead: {exc}") from exc


READ_ONLY = "hai_read_only"


def read_only(engine: Engine) -> Engine:
    """The same engine (and pool) for transactions that only read: deferred BEGIN on SQLite,
    no difference on PostgreSQL."""
    return engine.execution_options(**{READ_ONLY: True})


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
