"""What a running process shares: settings, the engine, sessions and the notifier."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field

from sqlalchemy import Engine, event
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session, sessionmaker

from hai.db.session import LoopStatements, make_engine, make_loop_engine, make_session_factory, read_only
from hai.services.nodes import NodeListCache
from hai.services.notify import Notifier, make_notifier
from hai.settings import Settings


@dataclass
class Platform:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    notifier: Notifier
    # for transactions that only read (GET requests, token look-ups): on SQLite they begin
    # deferred and do not queue for the write lock; the same sessions otherwise
    read_sessions: sessionmaker[Session] | None = None
    # GET /api/v1/nodes as this process last built it, while its revision is current (issue 12)
    node_list: NodeListCache = field(init=False)
    # PostgreSQL: per event loop, an engine of asyncio connections, sessions on it (loop_sessions)
    # and one of its connections held for single statements (loop_statements)
    _loop_engines: weakref.WeakKeyDictionary = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.node_list = NodeListCache(self.settings.http.node_list_max_age_s)
        self._loop_engines = weakref.WeakKeyDictionary()
        if self.read_sessions is None:
            self.read_sessions = (
                make_session_factory(read_only(self.engine)) if self.engine.dialect.name == "sqlite" else self.sessions
            )

    @classmethod
    def from_settings(cls, settings: Settings, *, notifier: Notifier | None = None) -> "Platform":
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        db = settings.db
        engine = make_engine(settings.database_url, echo=db.echo, prepared_statements=db.prepared_statements,
                             pool_size=db.pool_size, max_overflow=db.max_overflow)
        notifier = notifier or make_notifier(settings.redis.url, poll_s=settings.redis.poll_s)
        sessions = make_session_factory(engine)
        _publish_on_commit(sessions, notifier)
        return cls(settings=settings, engine=engine, sessions=sessions, notifier=notifier)

    def loop_sessions(self) -> sessionmaker[Session] | None:
        """Sessions for ``hai.db.session.on_loop`` on the running event loop (issue 12: submissions
        written without a worker thread): PostgreSQL with ``db.submit_on_loop``, else None (the
        caller uses ``sessions`` in a worker thread). Each loop has its own engine (an asyncio
        connection serves the loop it was made on), made on first use; ``close_loop`` disposes it."""
        entry = self._loop_entry()
        return entry[1] if entry is not None else None

    def loop_statements(self) -> LoopStatements | None:
        """Where ``loop_sessions`` are: the running loop's connection held for single statements
        in autocommit (``hai.db.session.LoopStatements``: a submission without a Session), else None."""
        entry = self._loop_entry()
        return entry[2] if entry is not None else None

    def _loop_entry(self) -> tuple[AsyncEngine, sessionmaker[Session], LoopStatements] | None:
        """The running loop's (engine, sessions, statements), made on first use; None unless
        PostgreSQL with ``db.submit_on_loop``."""
        if not self.settings.db.submit_on_loop or self.engine.dialect.name != "postgresql":
            return None
        loop = asyncio.get_running_loop()
        entry = self._loop_engines.get(loop)
        if entry is None:
            db = self.settings.db
            engine = make_loop_engine(self.settings.database_url, echo=db.echo, prepared_statements=db.prepared_statements)
            sessions = make_session_factory(engine.sync_engine)
            _publish_on_commit(sessions, self.notifier)
            self._loop_engines[loop] = entry = (engine, sessions, LoopStatements(engine))
        return entry

    async def close_loop(self) -> None:
        """Close the running loop's statement connection and dispose its engine of
        ``loop_sessions`` (its connections closed), if any."""
        entry = self._loop_engines.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            engine, _sessions, statements = entry
            await statements.close()
            await engine.dispose()

    def close(self) -> None:
        self.notifier.close()
        self.engine.dispose()


def _publish_on_commit(sessions: sessionmaker[Session], notifier: Notifier) -> None:
    """Topics queued with services.jobs.publish_after_commit go out once the data is visible."""

    def after_commit(session: Session) -> None:
        topics = session.info.pop("notify", None)
        if topics:
            notifier.publish(*sorted(topics))

    def after_rollback(session: Session) -> None:
        session.info.pop("notify", None)

    event.listen(sessions, "after_commit", after_commit)
    event.listen(sessions, "after_rollback", after_rollback)
