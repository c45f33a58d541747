"""Engine and session factory. Built on demand from settings, never at import time."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.util import greenlet_spawn

from hai.db.direct import DirectStatement, translated

log = logging.getLogger(__name__)


def _pg_connect_args(prepared_statements: bool) -> dict:
    """psycopg's arguments: ``prepare_threshold=None`` never prepares a statement on the server
    (behind PgBouncer in transaction mode, ``DatabaseSettings.prepared_statements``)."""
    return {} if prepared_statements else {"prepare_threshold": None}


def make_engine(
    url: str, *, echo: bool = False, prepared_statements: bool = True, pool_size: int = 20, max_overflow: int = 20
) -> Engine:
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
            if conn.get_execution_options().get(READ_ONLY):
                conn.exec_driver_sql("BEGIN")
                return
            owner = conn.connection.dbapi_connection
            gate.acquire(owner)
            try:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            except BaseException:
                gate.release(owner)
                raise

        gate = WriteGate(timeout_s=30.0)
        _gate_writers(engine, gate)
        _GATES[engine] = gate

        @event.listens_for(engine, "connect")
        def _no_pysqlite_begin(dbapi_conn, _record):  # noqa: ANN001
            dbapi_conn.isolation_level = None

        return engine
    # LIFO: a server hands out its most recently used connections (not pinged, see below) and
    # leaves the rest idle, rather than cycling every request through the whole pool
    engine = create_engine(url, echo=echo, pool_size=pool_size, max_overflow=max_overflow, pool_use_lifo=True,
                           connect_args=_pg_connect_args(prepared_statements))
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
_GATES: weakref.WeakKeyDictionary[Engine, WriteGate] = weakref.WeakKeyDictionary()


def write_gate(engine: Engine) -> WriteGate | None:
    """The WriteGate of a SQLite engine made by ``make_engine`` (None for other engines)."""
    return _GATES.get(engine)


class WriteGate:
    """SQLite's write lock taken in turn by the threads of one process, a thread lock in front of it.

    Without it every writer of the process (the API's request threads, the embedded scheduler)
    went straight to ``BEGIN IMMEDIATE``, and those that found the lock taken were left to
    SQLite's busy handler, which polls it with sleeps of 1, 2, 5, 10, ... 100 ms: a lock freed
    after 3 ms was taken again only when some sleeper woke. Measured in ``hai dev`` under 8
    submissions in flight (issue 12): BEGIN IMMEDIATE waited p50 0.3 ms but p90 31 ms, p99 202 ms,
    up to 745 ms, 12.5 ms on average per write. Behind the gate a writer waits on a thread lock
    that the previous writer releases as its COMMIT or ROLLBACK returns (no polling), and then
    takes SQLite's lock at once; the busy handler is left to arbitrate between processes only
    (the CLI, a separate scheduler). Not first come first served: a FIFO hand-over measured 15-20%
    fewer submissions a second (every hand-over a thread switch) for the same tail. A writer that
    waits longer than ``timeout_s`` (busy_timeout's 30 s) goes on to ``BEGIN IMMEDIATE`` without
    the gate and fails there as it would have before (``database is locked``)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._mutex = threading.Lock()
        self._owner: object | None = None

    def acquire(self, owner: object) -> bool:
        if not self._lock.acquire(timeout=self.timeout_s):
            log.warning("a SQLite writer waited %.0f s for this process's other writers; going on without the gate",
                        self.timeout_s)
            return False
        with self._mutex:
            self._owner = owner
        return True

    @property
    def held(self) -> bool:
        return self._owner is not None

    def release(self, owner: object) -> None:
        """Let the next writer in if ``owner`` holds the gate (a no-op otherwise: safe to call twice)."""
        with self._mutex:
            if self._owner is not owner:
                return
            self._owner = None
        self._lock.release()


def _gate_writers(engine: Engine, gate: WriteGate) -> None:
    """Release the gate when the transaction that holds it has ended in the database: after the
    dialect's COMMIT or ROLLBACK returns (SQLAlchemy's ``commit``/``rollback`` events fire before
    them, when the lock is still held), the pool's reset of a returned connection included; and
    when a connection is invalidated or closed."""
    dialect = engine.dialect

    def _after(end):  # noqa: ANN001, ANN202
        def ended(dbapi_connection):  # noqa: ANN001, ANN202
            try:
                return end(dbapi_connection)
            finally:
                gate.release(getattr(dbapi_connection, "dbapi_connection", dbapi_connection))
        return ended

    dialect.do_commit = _after(dialect.do_commit)
    dialect.do_rollback = _after(dialect.do_rollback)

    @event.listens_for(engine, "invalidate")
    def _invalidated(dbapi_conn, _record, _exc):  # noqa: ANN001
        gate.release(dbapi_conn)

    @event.listens_for(engine, "close")
    def _closed(dbapi_conn, _record):  # noqa: ANN001
        gate.release(dbapi_conn)


def read_only(engine: Engine) -> Engine:
    """The same engine (and pool) for transactions that only read: deferred BEGIN on SQLite,
    no difference on PostgreSQL."""
    return engine.execution_options(**{READ_ONLY: True})


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


# -- on the event loop (issue 12) -----------------------------------------------------------------
def make_loop_engine(url: str, *, echo: bool = False, prepared_statements: bool = True) -> AsyncEngine:
    """For a PostgreSQL ``url``: an engine whose connections are psycopg's asyncio connections,
    for work run on an event loop by ``on_loop`` (its pool belongs to the loop that first uses
    it; SQLite's work stays in worker threads). Small: a process's submissions are written by one
    writer at a time (api/jobs.SubmissionGroups). Idle connections are pinged on checkout as in
    ``make_engine``."""
    engine = create_async_engine(url, echo=echo, pool_size=2, max_overflow=4, pool_use_lifo=True,
                                 connect_args=_pg_connect_args(prepared_statements))
    _ping_idle_connections(engine.sync_engine)
    return engine


async def on_loop(fn, /, *args, **kwargs):  # noqa: ANN001, ANN201, ANN002, ANN003
    """``fn(*args, **kwargs)``, synchronous code, run on the running event loop rather than in a
    worker thread: what it does with sessions of a ``make_loop_engine`` engine's ``sync_engine``
    waits for the database by awaiting, letting the loop serve other requests meanwhile (SQLAlchemy's
    asyncio bridge: ``AsyncSession.run_sync`` runs its function the same way). Issue 12: a
    submission's hop to a worker thread and back was 0.16 ms of its 0.81 ms of server CPU."""
    return await greenlet_spawn(fn, *args, **kwargs)


class LoopStatements:
    """One connection of a loop engine (``make_loop_engine``) held by its event loop, in
    autocommit, for statements that are a whole transaction on their own: a PostgreSQL
    submission (``services.jobs._one_statement``) run by ``DirectStatement.first_on`` without a
    Session, a pool checkout and return, or a greenlet hop (issue 12: in process 0.49 -> 0.28 ms
    of CPU a submission, benchmarks/submit_inprocess.py --postgresql --loop); and for a few of
    them in one transaction, pipelined (``firsts_in_transaction``: a group of submissions, 0.37 ->
    0.24 ms a submission in groups of 8). One at a time (a process's submissions have one writer,
    api/jobs.SubmissionGroups; a lock keeps any other caller in turn). As the pool's connections,
    it is pinged before use when idle for PING_AFTER_IDLE_S or longer and replaced if dead; a
    statement that fails as a disconnect drops it (the API answers 503, the next one reconnects).
    ``close`` closes it (the app's shutdown, before the engine is disposed)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.dialect = engine.sync_engine.dialect
        self._held = None  # a connection checked out of the engine's pool for good (its proxy)
        self._used = 0.0  # time.monotonic() of its last statement
        self._lock: asyncio.Lock | None = None  # made on the loop that first uses it
        self.connects = 0  # connections taken from the pool (tests: a dead one was replaced)

    async def _connection(self):  # noqa: ANN202 - the driver's AsyncConnection
        held = self._held
        if held is not None and time.monotonic() - self._used >= PING_AFTER_IDLE_S:
            try:
                await held.driver_connection.execute("SELECT 1")
            except self.dialect.loaded_dbapi.Error as exc:
                log.info("the loop's statement connection is dead (%s); taking another", exc)
                await self._drop()
                held = None
        if held is None:
            try:  # (the pool pings one idle there, as for any checkout)
                held = await self.engine.raw_connection()
            except self.dialect.loaded_dbapi.Error as exc:
                # the server refused or dropped the new connection: raised as SQLAlchemy's own
                # Connection raises it (an OperationalError, the API's 503), not as the driver's
                # error, which the raw pool lets through (and the API answered 500)
                raise translated(self.dialect, exc) from exc
            try:
                await held.driver_connection.set_autocommit(True)
            except BaseException as exc:
                await greenlet_spawn(held.invalidate)
                if isinstance(exc, self.dialect.loaded_dbapi.Error):  # (closed under us) as SQLAlchemy raises it
                    raise DBAPIError.instance("autocommit", None, exc, self.dialect.loaded_dbapi.Error,
                                              dialect=self.dialect, connection_invalidated=True) from exc
                raise
            self._held = held
            self.connects += 1
        return held.driver_connection

    async def first(self, statement, params: dict):  # noqa: ANN001, ANN201
        """``statement`` (a ``DirectStatement``) run on the held connection: its first row, or None."""
        return await self._on_held(lambda conn: statement.first_on(self.dialect, conn, params))

    async def firsts_in_transaction(self, runs: list) -> list:
        """Each (``DirectStatement``, params) of ``runs`` in order on the held connection, in one
        transaction, pipelined (``DirectStatement.firsts_in_transaction_on``): the first row of
        each, or None; a failure rolls all of them back."""
        return await self._on_held(lambda conn: DirectStatement.firsts_in_transaction_on(self.dialect, conn, runs))

    async def _on_held(self, work):  # noqa: ANN001, ANN202
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            conn = await self._connection()
            try:
                return await work(conn)
            except DBAPIError as exc:
                # a disconnect, or a connection left inside a transaction: not used again
                if exc.connection_invalidated or conn.info.transaction_status.name != "IDLE":
                    await self._drop()
                raise
            except BaseException:  # (cancelled mid-statement) the connection's state is unknown
                await self._drop()
                raise
            finally:
                self._used = time.monotonic()

    async def _drop(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            await greenlet_spawn(held.invalidate)  # closed, and the pool's record with it

    async def close(self) -> None:
        await self._drop()
