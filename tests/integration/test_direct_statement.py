"""A statement run on the driver's cursor (hai.db.direct, issue 12): the same row as SQLAlchemy's
own execution gives, its errors raised as SQLAlchemy raises them, a dead connection
invalidated as SQLAlchemy invalidates it, and the caller's transaction or autocommit kept; on
PostgreSQL (named parameters) and on SQLite (positional ones, a parameter used twice)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import JSON, Column, DateTime, Integer, MetaData, String, Table, bindparam, func, insert, select, text
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
    Column("doc", JSON().with_variant(JSONB, "postgresql")),
)
_INSERT = insert(_things).values(name=bindparam("name"), at=bindparam("at"), plain_at=bindparam("plain_at"),
                                 doc=bindparam("doc", type_=_things.c.doc.type)).returning(*_things.c)
_PLAIN = insert(_things).values(name=bindparam("name"), at=bindparam("at"))  # no RETURNING
# a parameter twice, another between (SQLite's are positional: each in its place)
_SEEN = select(_things.c.id, _things.c.at).where(
    _things.c.name == bindparam("name"), _things.c.id > bindparam("after"), func.length(bindparam("name")) > 0)
_DIRECT = DirectStatement(_INSERT, {c.name: c.type for c in _things.c})
_DIRECT_PLAIN = DirectStatement(_PLAIN, {})
_DIRECT_SEEN = DirectStatement(_SEEN, {"at": _things.c.at.type})


@pytest.fixture
def engine(pg_url: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(db_session, "PING_AFTER_IDLE_S", 3600.0)  # a busy connection: not pinged
    engine = make_engine(pg_url)
    _meta.drop_all(engine)
    _meta.create_all(engine)
    yield engine
    _meta.drop_all(engine)
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_engine(request, tmp_path):  # noqa: ANN001, ANN201
    """As ``engine``, once on SQLite (hai's engine: WAL, the write gate) and once on PostgreSQL."""
    if request.param == "postgresql":
        yield request.getfixturevalue("engine")
        return
    engine = make_engine(f"sqlite:///{tmp_path / 'direct.db'}")
    _meta.create_all(engine)
    yield engine
    engine.dispose()


def _params(name: str) -> dict:
    at = datetime(2026, 12, 5, 9, 30, tzinfo=timezone(timedelta(hours=2)))
    return {"name": name, "at": at, "plain_at": at,
            "doc": {"command": ["sleep", "1"], "n": 2}}


def test_the_row_is_what_sqlalchemy_returns(any_engine) -> None:  # noqa: ANN001
    postgresql = any_engine.dialect.name == "postgresql"
    with any_engine.connect() as conn:
        if postgresql:
            conn.execute(text("SET TIME ZONE 'Asia/Shanghai'"))  # not UTC: the result processor must convert
        direct = _DIRECT.one(conn, _params("a"))
        through = conn.execute(_INSERT, _params("b")).one()
        conn.commit()
    assert direct._fields == tuple(through._fields)
    assert direct.name == "a" and direct.doc == through.doc == {"command": ["sleep", "1"], "n": 2}
    # the bind processor made the time UTC, the result processor gives it back in UTC
    assert direct.at == through.at == datetime(2026, 12, 5, 7, 30, tzinfo=timezone.utc)
    assert direct.at.tzinfo == through.at.tzinfo == timezone.utc
    assert direct.plain_at == through.plain_at  # no processor of ours: as the dialect gives it
    if postgresql:
        assert direct.plain_at.utcoffset() == timedelta(hours=8)  # the driver's, in the session's zone
    else:
        assert isinstance(direct.plain_at, datetime)  # SQLite's DATETIME parsed its text, as for `through`


def test_first_run_and_the_rows_written(any_engine) -> None:  # noqa: ANN001
    at = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)
    with any_engine.begin() as conn:  # (a transaction begun, as a Session's connection is)
        assert _DIRECT_PLAIN.run(conn, {"name": "plain", "at": at}) == 1
        assert _DIRECT_SEEN.first(conn, {"name": "nobody", "after": 0}) is None
        with pytest.raises(LookupError):
            _DIRECT_SEEN.one(conn, {"name": "nobody", "after": 0})
        seen = _DIRECT_SEEN.first(conn, {"name": "plain", "after": 0})
        assert _DIRECT_SEEN.first(conn, {"name": "plain", "after": seen.id}) is None
    with any_engine.connect() as conn:
        row = conn.execute(_SEEN, {"name": "plain", "after": 0}).one()
    assert seen == tuple(row) and seen.at == at and seen.at.tzinfo == timezone.utc


def test_it_runs_in_the_callers_transaction_or_autocommit(any_engine) -> None:  # noqa: ANN001
    with any_engine.connect() as conn:
        conn.begin()  # (as a Session's connection is)
        _DIRECT.one(conn, _params("rolled back"))
        conn.rollback()
    with any_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        _DIRECT.one(conn, _params("kept"))  # committed by itself: the connection is closed without a commit
    with any_engine.connect() as conn:
        assert conn.scalars(select(_things.c.name)).all() == ["kept"]


def test_a_driver_error_is_raised_as_sqlalchemy_raises_it(any_engine) -> None:  # noqa: ANN001
    with any_engine.connect() as conn:
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


# -- on an asyncio driver connection, without a SQLAlchemy connection (LoopStatements) ----------
def _on_loop(pg_url: str, scenario):  # noqa: ANN001, ANN202
    """``scenario(statements)`` on a fresh event loop, with a loop engine's LoopStatements (closed after)."""
    import asyncio

    from hai.db.session import LoopStatements, make_loop_engine

    async def run():  # noqa: ANN202
        engine = make_loop_engine(pg_url)
        statements = LoopStatements(engine)
        try:
            return await scenario(statements)
        finally:
            await statements.close()
            await engine.dispose()

    return asyncio.run(run())


def test_first_on_gives_the_row_sqlalchemy_gives_in_autocommit(engine, pg_url: str) -> None:  # noqa: ANN001
    async def scenario(statements):  # noqa: ANN001, ANN202
        row = await statements.first(_DIRECT, _params("loop"))
        seen = await statements.first(_DIRECT_SEEN, {"name": "loop", "after": 0})
        nobody = await statements.first(_DIRECT_SEEN, {"name": "nobody", "after": 0})
        return row, seen, nobody, statements._held.driver_connection.autocommit

    row, seen, nobody, autocommit = _on_loop(pg_url, scenario)
    with engine.connect() as conn:
        through = conn.execute(select(_things).where(_things.c.name == "loop")).one()  # committed by itself
    assert autocommit and nobody is None
    assert row._fields == tuple(through._fields) and tuple(row) == tuple(through)
    assert row.at == datetime(2026, 12, 5, 7, 30, tzinfo=timezone.utc) and row.at.tzinfo == timezone.utc
    assert row.doc == {"command": ["sleep", "1"], "n": 2}
    assert (seen.id, seen.at) == (row.id, row.at)


def test_first_on_raises_driver_errors_as_sqlalchemy_and_keeps_a_live_connection(engine, pg_url: str) -> None:  # noqa: ANN001
    async def scenario(statements):  # noqa: ANN001, ANN202
        await statements.first(_DIRECT, _params("same"))
        with pytest.raises(IntegrityError) as failed:
            await statements.first(_DIRECT, _params("same"))
        assert not failed.value.connection_invalidated
        assert statements._held is not None  # not a disconnect: the connection is kept
        return (await statements.first(_DIRECT, _params("other"))).name, statements.connects

    assert _on_loop(pg_url, scenario) == ("other", 1)


def test_a_statement_connection_lost_mid_use_is_a_disconnect_and_replaced(engine, pg_url: str) -> None:  # noqa: ANN001
    """The server gone while the connection is busy (not idle long enough to be pinged): the
    statement fails as a disconnect (the API's 503), the connection is dropped, the next
    statement gets a new one."""
    from tests.integration.test_pool_ping import _terminate

    async def scenario(statements):  # noqa: ANN001, ANN202
        first = await statements.first(_DIRECT, _params("before"))
        _terminate(pg_url, statements._held.driver_connection.info.backend_pid)
        with pytest.raises(OperationalError) as failed:
            await statements.first(_DIRECT, _params("lost"))
        assert failed.value.connection_invalidated and statements._held is None
        after = await statements.first(_DIRECT, _params("after"))
        return first.name, after.name, statements.connects

    assert _on_loop(pg_url, scenario) == ("before", "after", 2)
    with engine.connect() as conn:
        assert sorted(conn.scalars(select(_things.c.name))) == ["after", "before"]


def test_an_idle_dead_statement_connection_is_pinged_and_replaced(engine, pg_url: str, monkeypatch) -> None:  # noqa: ANN001
    from tests.integration.test_pool_ping import _terminate

    async def scenario(statements):  # noqa: ANN001, ANN202
        await statements.first(_DIRECT, _params("before"))
        _terminate(pg_url, statements._held.driver_connection.info.backend_pid)
        monkeypatch.setattr(db_session, "PING_AFTER_IDLE_S", 0.0)  # (as after an idle second)
        return (await statements.first(_DIRECT, _params("after"))).name, statements.connects

    assert _on_loop(pg_url, scenario) == ("after", 2)  # no error: the ping found it dead first


def test_a_server_refusing_the_statement_connection_is_raised_as_unavailable() -> None:
    """No connection held and the server refusing a new one (PostgreSQL stopped: the fault test's
    submission after ``pg_ctl stop``): the driver's error is raised as SQLAlchemy's
    OperationalError, which the API answers 503, as its ``Connection`` raises it; the raw pool let
    psycopg's own through and the API answered 500."""
    import socket

    from hai.api.errors import database_unavailable

    with socket.socket() as closed:  # bound, never listening: connections to it are refused
        closed.bind(("127.0.0.1", 0))
        url = f"postgresql+psycopg://postgres@127.0.0.1:{closed.getsockname()[1]}/nowhere"

        async def scenario(statements):  # noqa: ANN001, ANN202
            with pytest.raises(OperationalError) as failed:
                await statements.first(_DIRECT, _params("refused"))
            return failed.value, statements._held, statements.connects

        refused, held, connects = _on_loop(url, scenario)
    assert "refused" in str(refused.orig) and database_unavailable(refused)
    assert held is None and connects == 0
