"""The PostgreSQL pool pings only connections that sat idle (issue 12: the ping was a round trip
in every request). A dead idle connection is replaced on checkout without the caller seeing
an error; a dead busy one fails its statement as a disconnect (the API's 503), SQLAlchemy
invalidates the pool, and the next checkout works."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from hai.db import session as db_session
from hai.db.session import make_engine


def _backend_pid(engine) -> int:  # noqa: ANN001
    with engine.connect() as conn:
        return conn.execute(text("SELECT pg_backend_pid()")).scalar_one()


def _terminate(url: str, pid: int) -> None:
    killer = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with killer.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar_one()
    finally:
        killer.dispose()


def test_a_recently_used_connection_is_not_pinged(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(db_session, "PING_AFTER_IDLE_S", 3600.0)  # "recently": whatever the machine's load
    engine = make_engine(pg_url)
    try:
        pid = _backend_pid(engine)
        pings = []
        original = engine.dialect.do_ping
        engine.dialect.do_ping = lambda conn: pings.append(conn) or original(conn)
        assert _backend_pid(engine) == pid  # the same pooled connection, handed out at once
        assert pings == []
    finally:
        engine.dispose()


def test_a_dead_idle_connection_is_replaced_on_checkout(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(db_session, "PING_AFTER_IDLE_S", 0.0)  # every checked-in connection counts as idle
    engine = make_engine(pg_url)
    try:
        pid = _backend_pid(engine)
        _terminate(pg_url, pid)
        assert _backend_pid(engine) != pid  # pinged, found dead, replaced: no error for the caller
    finally:
        engine.dispose()


def test_a_dead_busy_connection_fails_once_then_the_pool_recovers(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db_session, "PING_AFTER_IDLE_S", 3600.0)
    engine = make_engine(pg_url)
    try:
        pid = _backend_pid(engine)
        _terminate(pg_url, pid)
        with pytest.raises(OperationalError) as failed:  # used recently: not pinged
            _backend_pid(engine)
        assert failed.value.connection_invalidated  # a disconnect: the API maps it to 503
        assert _backend_pid(engine) != pid  # the pool was invalidated; a fresh connection works
    finally:
        engine.dispose()
