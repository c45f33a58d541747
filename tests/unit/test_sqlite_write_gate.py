"""SQLite writers of one process take the write lock in turn behind a thread lock (issue 12:
SQLite's busy handler polled it with sleeps, up to 745 ms per BEGIN under 8 submissions in flight).
With busy_timeout 0 any writer that reaches BEGIN IMMEDIATE while another transaction holds the
lock fails at once: these tests fail without the gate, or with a gate released before COMMIT."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import event, text

from hai.db.session import make_engine, make_session_factory, read_only, write_gate


@pytest.fixture
def sessions(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'gate.db'}")

    @event.listens_for(engine, "connect")
    def _no_busy_handler(dbapi_conn, _record):  # noqa: ANN001 - after make_engine's pragmas
        dbapi_conn.execute("PRAGMA busy_timeout=0")

    factory = make_session_factory(engine)
    with factory() as s:
        s.execute(text("CREATE TABLE t (writer INTEGER, n INTEGER)"))
        s.commit()
    yield factory
    engine.dispose()


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()


def test_writers_of_one_process_never_meet_in_sqlite(sessions):
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def writer(i: int) -> None:
        start.wait()
        try:
            for _ in range(40):
                with sessions() as s:  # read, then write what was read: a transaction of three statements
                    n = s.execute(text("SELECT count(*) FROM t WHERE writer = :w"), {"w": i}).scalar()
                    s.execute(text("INSERT INTO t VALUES (:w, :n)"), {"w": i, "n": n})
                    s.commit()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _run([threading.Thread(target=writer, args=(i,)) for i in range(8)])
    assert errors == []
    with sessions() as s:
        assert s.execute(text("SELECT count(*), count(DISTINCT writer || '-' || n) FROM t")).one() == (320, 320)


def test_a_writer_that_rolls_back_or_fails_lets_the_next_one_in(sessions):
    gate = write_gate(sessions.kw["bind"])
    with sessions() as s:  # rolled back by close
        s.execute(text("INSERT INTO t VALUES (1, 1)"))
        assert gate.held
    assert not gate.held
    with pytest.raises(RuntimeError), sessions() as s, s.begin():  # rolled back by the error
        s.execute(text("INSERT INTO t VALUES (2, 2)"))
        raise RuntimeError("boom")
    assert not gate.held
    with sessions() as s:  # a failed statement, then a rollback
        with pytest.raises(Exception, match="no such table"):
            s.execute(text("INSERT INTO missing VALUES (1)"))
        s.rollback()
        assert not gate.held
    conn = sessions.kw["bind"].connect()  # a connection invalidated mid-transaction
    conn.execute(text("INSERT INTO t VALUES (4, 4)"))
    assert gate.held
    conn.invalidate()
    conn.close()
    assert not gate.held
    done = []

    def later() -> None:
        with sessions() as s:
            s.execute(text("INSERT INTO t VALUES (3, 3)"))
            s.commit()
        done.append(True)

    _run([threading.Thread(target=later)])
    assert done == [True] and not gate.held
    with sessions() as s:
        assert s.execute(text("SELECT writer FROM t")).scalars().all() == [3]


def test_readers_do_not_wait_for_the_gate(sessions):
    writing = sessions()
    writing.execute(text("INSERT INTO t VALUES (1, 1)"))  # holds the gate and SQLite's lock
    try:
        reader = make_session_factory(read_only(writing.get_bind()))
        seen = []
        t = threading.Thread(target=lambda: seen.append(reader().execute(text("SELECT count(*) FROM t")).scalar()))
        _run([t])
        assert seen == [0]  # its snapshot, beside the writer
    finally:
        writing.commit()
        writing.close()
