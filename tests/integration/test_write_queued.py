"""Issue 12: a cycle writes the pending reason and the reservation of the queued jobs whose only
change they are (``scheduling.apply_decisions``): on PostgreSQL in one UPDATE over arrays for all
of them, where it used to be one UPDATE a job (the cycle after a burst of submissions gives each
new job its reason), on SQLite one a job. The rules are the same on both: only a job still
queued is written, the reason of a job its owner holds is kept, and a job given no reason keeps
the one it has."""

from __future__ import annotations

from sqlalchemy import create_engine, event, select, text
from sqlalchemy.orm import sessionmaker

from hai.db.base import utcnow
from hai.db.migrate import downgrade, upgrade
from hai.db.models import Base, Job
from hai.domain import scheduler as sched
from hai.domain.jobs import JobState
from hai.services import auth, scheduling
from hai.settings import Settings


def _job(session, user, name: str, *, state: str = JobState.QUEUED.value, held: bool = False) -> Job:  # noqa: ANN001
    now = utcnow()
    job = Job(name=name, user_id=user.id, user_name=user.name, group=user.group, command=["true"], nodes=1,
              gpus_per_node=1, state=state, created_at=now, queued_at=now, pending_reason="waiting",
              reserved_nodes=[], user_suspended=held)
    session.add(job)
    return job


# text that a literal or an encoding could mangle: quotes, a backslash, braces and a comma (an
# array literal's syntax), a JSON escape, a newline, accents and a character beyond the BMP
ODD_REASON = 'Reserved: "n\'1", {a,b} \\u0041 \\ naïve ✓ 😀\nsecond line'
ODD_NODE = 'node "x", {y}\\z'


def test_queued_jobs_reasons_and_reservations_written_by_the_rules_in_one_statement(sessions):
    with sessions() as s:
        user, _ = auth.create_user(session=s, name="alice", group="g")
        jobs = {name: _job(s, user, name) for name in ("a", "b", "c", "d", "e")}
        jobs["held"] = _job(s, user, "held", held=True)
        jobs["running"] = _job(s, user, "running", state=JobState.RUNNING.value)
        s.commit()
        ids = {name: job.id for name, job in jobs.items()}

    decisions = sched.Decisions(
        reservations={ids["b"]: ("n1", "n2"), ids["held"]: ("n3",), ids["d"]: ("n4",), ids["e"]: (ODD_NODE,)},
        pending_reasons={ids["a"]: "Resources: no node has 1 free GPU", ids["b"]: "Reserved: n1, n2",
                         ids["c"]: "Priority: behind job 1", ids["held"]: "Priority: behind job 2",
                         ids["running"]: "Priority: behind job 3", ids["e"]: ODD_REASON},
    )
    # d: its reservation only (no reason: it keeps its own); running: no longer queued
    statements: list[tuple[str, bool]] = []  # (statement, executemany)
    with sessions() as s:
        engine = s.get_bind()
        dialect = engine.dialect.name

        def seen(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001, ANN202, PLR0913
            if statement.lstrip().upper().startswith("UPDATE JOBS"):
                statements.append((statement, executemany))

        event.listen(engine, "before_cursor_execute", seen)
        try:
            scheduling.apply_decisions(s, decisions, settings=Settings(), now=utcnow())
            s.commit()
        finally:
            event.remove(engine, "before_cursor_execute", seen)

    with sessions() as s:
        rows = {j.name: (j.pending_reason, list(j.reserved_nodes)) for j in s.scalars(select(Job))}
    assert rows == {
        "a": ("Resources: no node has 1 free GPU", []),
        "b": ("Reserved: n1, n2", ["n1", "n2"]),
        "c": ("Priority: behind job 1", []),
        "d": ("waiting", ["n4"]),
        "e": (ODD_REASON, [ODD_NODE]),  # the text as given, whatever it holds
        "held": ("waiting", ["n3"]),  # held by its owner: its reason stays
        "running": ("waiting", []),  # not queued: not written
    }
    # one call: on SQLite an executemany of the UPDATE (one statement a job); on PostgreSQL one
    # statement over one JSON document of the writes, executed once
    assert len(statements) == 1
    statement, many = statements[0]
    if dialect == "postgresql":
        assert not many and "json_array_elements" in statement
    else:
        assert many


def _row_versions(sessions) -> dict[str, object]:  # noqa: ANN001
    """Each job's row version by name: what changes whenever the row is written (PostgreSQL: the
    writing transaction, ``xmin``; SQLite: the change marker its triggers set, ``change_seq``)."""
    with sessions() as s:
        version = "xmin::text" if s.get_bind().dialect.name == "postgresql" else "change_seq"
        return dict(s.execute(text(f"SELECT name, {version} FROM jobs")).all())


def test_only_what_differs_from_what_the_queue_shows_is_written(sessions):
    """With ``current`` (``Shown``: what the snapshot's queued jobs show, as the queue cache keeps
    it), a queued job is written only where the cycle's reason or reservation differs from it: a
    job shown with the same reason and reservation is not written (its row unchanged, though its
    stored reason differs: the shown state is what counts); a new reason, a new reservation, a
    reservation dropped and a job not shown at all are."""
    with sessions() as s:
        user, _ = auth.create_user(session=s, name="alice", group="g")
        jobs = {name: _job(s, user, name) for name in ("same", "reason", "moved", "dropped", "unshown")}
        for name, nodes in (("same", ["n1"]), ("moved", ["n1"]), ("dropped", ["n2"])):
            jobs[name].reserved_nodes = nodes  # the reservations as shown (the reasons all "waiting")
        s.commit()
        ids = {name: job.id for name, job in jobs.items()}
    shown = scheduling.Shown()
    shown.set(ids["same"], "Resources: one", ("n1",))
    shown.set(ids["reason"], "Resources: one", ())
    shown.set(ids["moved"], "Reserved: n1", ("n1",))
    shown.set(ids["dropped"], "Reserved: n2", ("n2",))
    decisions = sched.Decisions(
        reservations={ids["same"]: ("n1",), ids["moved"]: ("n3",)},
        pending_reasons={ids["same"]: "Resources: one", ids["reason"]: "Resources: two", ids["moved"]: "Reserved: n1",
                         ids["dropped"]: "Reserved: n2", ids["unshown"]: "Resources: three"},
    )
    before = _row_versions(sessions)
    with sessions() as s:
        scheduling.apply_decisions(s, decisions, settings=Settings(), now=utcnow(), current=shown)
        s.commit()
    after = _row_versions(sessions)
    assert {name for name in after if after[name] != before[name]} == {"reason", "moved", "dropped", "unshown"}
    with sessions() as s:
        rows = {j.name: (j.pending_reason, list(j.reserved_nodes)) for j in s.scalars(select(Job))}
    assert rows == {
        "same": ("waiting", ["n1"]),  # as shown: not written
        "reason": ("Resources: two", []),
        "moved": ("waiting", ["n3"]),  # its reservation only (its reason as shown)
        "dropped": ("waiting", []),
        "unshown": ("Resources: three", []),
    }


def _fillfactor(engine) -> list[str] | None:  # noqa: ANN001
    with engine.connect() as conn:
        return conn.execute(text("SELECT reloptions FROM pg_class WHERE relname = 'jobs'")).scalar_one()


def test_the_jobs_table_keeps_room_in_its_pages_after_0021_and_in_the_models(pg_url, second_pg_url):
    """Migration 0021 sets fillfactor 80 on jobs (and 0020 has none); ``create_all`` of the models
    (the test platform, ``hai dev`` on PostgreSQL) gives the same."""
    engine = create_engine(pg_url)
    upgrade(pg_url, "0020")
    assert _fillfactor(engine) is None
    upgrade(pg_url)
    assert _fillfactor(engine) == ["fillfactor=80"]
    downgrade(pg_url, "0020")
    assert _fillfactor(engine) is None
    engine.dispose()
    models = create_engine(second_pg_url)
    Base.metadata.create_all(models)
    assert _fillfactor(models) == ["fillfactor=80"]
    models.dispose()


def test_a_queued_jobs_new_reason_stays_in_its_page(pg_url):
    """What the room is for: a queued job's rewritten reason is written in the row's own page
    (``ctid``'s block), where a full page sends it to another, with a new entry in every index."""
    upgrade(pg_url)
    engine = create_engine(pg_url)
    factory = sessionmaker(engine, expire_on_commit=False)
    with factory() as s:
        user, _ = auth.create_user(session=s, name="alice", group="g")
        for i in range(200):  # several pages, each filled as far as inserts fill it
            _job(s, user, f"j{i}")
        s.commit()
    with engine.connect() as conn:
        blocks = dict(conn.execute(text("SELECT id, (ctid::text::point)[0]::int FROM jobs ORDER BY id")).all())
        first_page = [i for i, b in blocks.items() if b == 0]
        assert len(first_page) > 5 and max(blocks.values()) >= 2
        scheduling.write_queued_pg(conn, [(i, ["n1"], "Resources: no node has 1 free GPU") for i in first_page[:3]])
        conn.commit()
        after = dict(conn.execute(text("SELECT id, (ctid::text::point)[0]::int FROM jobs WHERE id = ANY(:i)"),
                                  {"i": first_page[:3]}).all())
        assert after == {i: 0 for i in first_page[:3]}
        reasons = set(conn.execute(text("SELECT pending_reason FROM jobs WHERE id = ANY(:i)"), {"i": first_page[:3]}).scalars())
        assert reasons == {"Resources: no node has 1 free GPU"}
    engine.dispose()
