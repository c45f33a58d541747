"""A statement run on the driver's cursor (hai.db.direct, issue 12): the same row as SQLAlchemy's
own execution gives, its errors raised as SQLAlchemy raises them, a dead connection
invalidated as SQLAlchemy invalidates it, and the caller's transaction or autocommit kept."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, bindparam, insert, select, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import IntegrityError, OperationalError

from hai.db import session as db_session
from hai.db.base import UTCDateTime
from hai.db.direct import DirectStatement
from hai.db.session import make_engine

_meta = MetaData()
_things = Table(
    "direct_things", _meta,
    Column("id", Integer, primary_key=True),
    Column("name", String(40), unique=True),
    Column("at", UTCDateTime),
    Column("plain_at", DateTime(timezone=True)),
    Column("doc", JSONB),
)
_INSERT = insert(_things).values(name=bindparam("name"), at=bindparam("at"), plain_at=bindparam("at"),
                                 doc=bindparam("doc", type_=JSONB)).returning(*_things.c)
_DIRECT = DirectStatement(_INSERT, {c.name: c.type for c in _things.c})


@pytest.fixture
def engine(pg_url: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(db_session, "PING_AFTER_IDLE_S", 3600.0)  # a busy connection: not pinged
    engine = make_engine(pg_url)
    _meta.drop_all(engine)
    _meta.create_all(engine)
    yield engine
    _meta.drop_all(engine)
    engine.dispose()


def _params(name: str) -> dict:
    return {"name": name, "at": datetime(2026, 12, 5, 9, 30, tzinfo=timezone(timedelta(hours=2))),
            "doc": {"command": ["sleep", "1"], "n": 2}}


def test_the_row_is_what_sqlalchemy_returns(engine) -> None:  # noqa: ANN001
    with engine.connect() as conn:
        conn.execute(text("SET TIME ZONE 'Asia/Shanghai'"))  # not UTC: the result processor must convert
        direct = _DIRECT.one(conn, _params("a"))
        through = conn.execute(_INSERT, _params("b")).one()
        conn.commit()
    assert direct._fields == tuple(through._fields)
    assert direct.name == "a" and direct.doc == through.doc == {"command": ["sleep", "1"], "n": 2}
    # the bind processor made the time UTC, the result processor gives it back in UTC
    assert direct.at == through.at == datetime(2026, 12, 5, 7, 30, tzinfo=timezone.utc)
    assert direct.at.tzinfo == through.at.tzinfo == timezone.utc
    assert direct.plain_at == through.plain_at  # no processor: as the driver gives it (the session's zone)
    assert direct.plain_at.utcoffset() == timedelta(hours=8)


def test_it_runs_in_the_callers_transaction_or_autocommit(engine) -> None:  # noqa: ANN001
    with engine.connect() as conn:
        _DIRECT.one(conn, _params("rolled back"))
        conn.rollback()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        _DIRECT.one(conn, _params("kept"))  # committed by itself: the connection is closed without a commit
    with engine.connect() as conn:
        assert conn.scalars(select(_things.c.name)).all() == ["kept"]


def test_a_driver_error_is_raised_as_sqlalchemy_raises_it(engine) -> None:  # noqa: ANN001
    with engine.connect() as conn:
        _DIRECT.one(conn, _params("same"))
        with pytest.raises(IntegrityError) as failed:
            _DIRECT.one(conn, _params("same"))
        assert "direct_things_name" in str(failed.value) or "unique" in str(failed.value).lower()
        assert not failed.value.connection_invalidated
        conn.rollback()
        assert _DIRECT.one(conn, _params("other")).name == "other"  # the connection still works


def test_a_dead_connection_is_invalidated_and_the_pool_recovers(engine, pg_url: str) -> None:  # noqa: ANN001
    with engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    from tests.integration.test_pool_ping import _terminate
    _terminate(pg_url, pid)
    with engine.connect() as conn, pytest.raises(OperationalError) as failed:
        _DIRECT.one(conn, _params("lost"))
    assert failed.value.connection_invalidated  # a disconnect: the API maps it to 503
    with engine.connect() as conn:
        assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
        assert _DIRECT.one(conn, _params("after")).name == "after"
        conn.commit()
