"""Single submissions written together (issue 12, group commit): ``submissions.submit_group`` writes
the submissions that arrived while another group was being written in one transaction, each
answered as it would be answered alone, one after another; ``api.jobs.SubmissionGroups`` gathers
them from concurrent requests. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from sqlalchemy import delete, event, func, select
from sqlalchemy.exc import IntegrityError, OperationalError

from hai.api.jobs import EarlySubmissions
from hai.db.models import IdempotencyKey, Job, JobEvent
from hai.schemas.jobs import JobCreate
from hai.services import auth, submissions
from hai.services import jobs as job_service
from hai.services.errors import Invalid, TooMany
from hai.settings import LimitsSettings
from tests.conftest import Api, api_with_two_nodes, uvicorn_thread

LIMITS = LimitsSettings(max_queued_jobs_per_user=3)


@pytest.fixture(params=["sqlite", "postgresql"])
def api(request, tmp_path):
    """An Api (users alice and bob, two 8-GPU nodes) on a migrated database, SQLite and PostgreSQL."""
    url = f"sqlite:///{tmp_path / 'hai.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    with api_with_two_nodes(url, tmp_path) as a:
        yield a


def _user(api: Api, token: str) -> auth.Principal:
    with api.platform.sessions() as s:
        return auth.authenticate(session=s, secret=token)


def _spec(name: str, **kw) -> JobCreate:  # noqa: ANN003
    return JobCreate.model_validate({"name": name, "command": ["echo", name], "gpus_per_node": 1} | kw)


def _items(api: Api) -> list[submissions.Single]:
    """Each kind of answer, and submissions that depend on those before them in the group."""
    alice, bob = _user(api, api.alice), _user(api, api.bob)
    return [
        (_spec("a1"), alice, None),                      # 201
        (_spec("too-big", nodes=3), alice, None),        # 422: the cluster has 2 nodes
        (_spec("a2"), alice, "k1"),                      # 201, key k1
        (_spec("a2"), alice, "k1"),                      # 200: k1's job (written just before, same group)
        (_spec("other"), alice, "k1"),                   # 422: k1 with another body
        (_spec("b1"), bob, "k1"),                        # 201: keys are per user
        (_spec("a3"), alice, None),                      # 201: alice's third queued job
        (_spec("a4"), alice, None),                      # 429: alice has 3 queued (limit 3)
        (_spec("a4"), alice, "k2"),                      # 429, and k2 not kept
        (_spec("b2", priority="HIGH"), bob, None),       # 201
    ]


def _answers(outcomes: list) -> list[tuple]:  # noqa: ANN001
    """Each answer without what differs between two databases' runs (ids, times)."""
    got = []
    for o in outcomes:
        if isinstance(o, submissions.Submitted):
            j = o.job
            got.append(("replayed" if o.replayed else "created", j.name, j.user, j.state.value, j.priority.value,
                        [(e.from_state, e.to_state, e.reason) for e in j.events]))
        else:  # (a refusal may name a job by its id: the id differs between the runs)
            got.append((type(o).__name__, re.sub(r"\(job \d+\)", "(job N)", str(o))))
    return got


def _stored(api: Api) -> list[tuple]:
    with api.platform.sessions() as s:
        jobs = [(j.name, j.user_name, j.state, len(j.events)) for j in s.scalars(select(Job).order_by(Job.id))]
        keys = sorted((k.user_id, k.key, s.get(Job, k.job_id).name) for k in s.scalars(select(IdempotencyKey)))
        return jobs + keys


async def _until(predicate, what: str, timeout: float = 30.0) -> None:  # noqa: ANN001
    """Wait on the event loop (which goes on serving meanwhile) until ``predicate()`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)


def _clear(api: Api) -> None:
    with api.platform.sessions() as s:
        for table in (IdempotencyKey, JobEvent, Job):
            s.execute(delete(table))
        s.commit()


def test_a_group_answers_each_submission_as_it_would_be_answered_alone(api):
    items = _items(api)
    alone = []
    for spec, user, key in items:
        with api.platform.sessions() as s:
            try:
                alone.append(submissions.submit(session=s, spec=spec, user=user, limits=LIMITS, idempotency_key=key))
            except (Invalid, TooMany) as exc:
                alone.append(exc)
    stored_alone = _stored(api)
    _clear(api)

    grouped = submissions.submit_group(sessions=api.platform.sessions, items=items, limits=LIMITS)

    assert _answers(grouped) == _answers(alone)
    assert [a[0] for a in _answers(grouped)] == ["created", "Invalid", "created", "replayed", "Invalid", "created",
                                                 "created", "TooMany", "TooMany", "created"]
    assert grouped[3].job.id == grouped[2].job.id  # the replay is k1's job, written in the same group
    assert "the cluster has 2 node(s)" in str(grouped[1])
    assert f"used with another request body (job {grouped[2].job.id})" in str(grouped[4])
    assert _stored(api) == stored_alone
    assert [row[0] for row in _stored(api)[:5]] == ["a1", "a2", "b1", "a3", "b2"]
    with api.platform.sessions() as s:
        assert s.scalar(select(func.count(Job.id))) == 5 and s.scalar(select(func.count(IdempotencyKey.id))) == 2


def test_a_group_is_one_transaction(api):
    items = _items(api)[:4]
    commits = []

    def committed(conn) -> None:  # noqa: ANN001
        commits.append(conn)

    event.listen(api.platform.engine, "commit", committed)
    try:
        out = submissions.submit_group(sessions=api.platform.sessions, items=items, limits=LIMITS)
    finally:
        event.remove(api.platform.engine, "commit", committed)
    assert [type(o).__name__ for o in out] == ["Submitted", "Invalid", "Submitted", "Submitted"]
    assert len(commits) == 1


def test_a_failure_of_the_group_writes_none_of_it(api, monkeypatch):
    real = job_service.submit_admitted
    calls = []

    def third_fails(**kw):  # noqa: ANN003, ANN202 - the database goes away at the third submission
        calls.append(1)
        if len(calls) == 3:
            raise OperationalError("INSERT ...", {}, Exception("server closed the connection unexpectedly"))
        return real(**kw)

    monkeypatch.setattr(job_service, "submit_admitted", third_fails)
    with pytest.raises(OperationalError):
        submissions.submit_group(sessions=api.platform.sessions, items=_items(api), limits=LIMITS)
    assert _stored(api) == []  # the two before it were rolled back with it


def test_a_key_committed_by_another_process_meanwhile_sends_the_group_one_by_one(api, monkeypatch):
    real = job_service.submit_admitted
    raised = []

    def race_once(**kw):  # noqa: ANN003, ANN202 - the key's insert meets another process's row, once
        if kw.get("idempotency") and not kw.get("commit", True) and not raised:
            raised.append(1)
            raise IntegrityError("INSERT INTO idempotency_keys ...", {}, Exception("duplicate key value"))
        return real(**kw)

    items = _items(api)
    monkeypatch.setattr(job_service, "submit_admitted", race_once)
    out = submissions.submit_group(sessions=api.platform.sessions, items=items, limits=LIMITS)
    assert raised == [1]
    assert [a[0] for a in _answers(out)] == ["created", "Invalid", "created", "replayed", "Invalid", "created",
                                             "created", "TooMany", "TooMany", "created"]
    assert [row[0] for row in _stored(api)][:5] == ["a1", "a2", "b1", "a3", "b2"]


def _early(app) -> EarlySubmissions:  # noqa: ANN001
    layer = app.middleware_stack
    while not isinstance(layer, EarlySubmissions):
        layer = layer.app
    return layer


def test_concurrent_requests_are_written_as_groups_and_each_gets_its_own_answer(api, monkeypatch):
    """16 requests in flight: the first group is held until the 15 others wait (no timing left to
    chance); they are then one group, each answered with its own job (or refusal)."""
    from hai.api.jobs import SubmissionGroups

    app = api.client.app
    early = _early(app)
    real = SubmissionGroups._written
    first = asyncio.Event()

    async def held_first(platform, items):  # noqa: ANN001, ANN202 - held on the loop, which goes on serving
        if not first.is_set():
            first.set()
            await _until(lambda: len(early.grouped._waiting) == 15, "15 submissions waiting")
        return await real(platform, items)

    monkeypatch.setattr(SubmissionGroups, "_written", staticmethod(held_first))
    bodies = [{"name": f"j{i}", "command": ["echo", str(i)], "gpus_per_node": 1 + i % 8} for i in range(15)]
    bodies.insert(7, {"name": "too-big", "command": ["true"], "nodes": 3, "gpus_per_node": 8})  # 422 in the group
    with uvicorn_thread(app, log_level="warning") as url:
        headers = api.h(api.bob)

        async def post_all() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as c:
                await c.get("/api/v1/jobs", params={"limit": 1})  # bob's credential cached: the early path
                return await asyncio.gather(*(c.post("/api/v1/jobs", json=b) for b in bodies))

        before = early.answered
        rs = asyncio.run(post_all())
    assert early.answered - before == 16
    assert (early.grouped.groups, early.grouped.largest) == (2, 15)
    assert [r.status_code for r in rs] == [201] * 7 + [422] + [201] * 8
    created = [r.json() for r in rs if r.status_code == 201]
    assert [j["name"] for j in created] == [b["name"] for b in bodies if b["name"] != "too-big"]
    assert [j["gpus_per_node"] for j in created] == [b["gpus_per_node"] for b in bodies if b["name"] != "too-big"]
    assert len({j["id"] for j in created}) == 15
    assert rs[7].json()["detail"][0]["loc"][-1] == "nodes"
    with api.platform.sessions() as s:
        assert sorted(s.scalars(select(Job.name))) == sorted(j["name"] for j in created)
        assert s.scalar(select(func.count(JobEvent.id))) == 15


def test_a_writer_left_on_a_closed_event_loop_does_not_hold_the_next_loops_submissions(api):
    """One process, two event loops one after the other (a test client's portal each request): the
    first loop closed with its writer pending; the next loop's submission is written all the same."""
    from hai.api.jobs import SubmissionGroups

    groups = SubmissionGroups()
    old = asyncio.new_event_loop()
    groups._loop, groups._writer = old, old.create_future()  # (a writer that will never finish)
    groups._waiting.append(((_spec("lost"), _user(api, api.alice), None), old.create_future()))
    old.close()

    async def one() -> submissions.Submitted:
        try:
            return await asyncio.wait_for(groups.submit(api.platform, (_spec("next"), _user(api, api.alice), None)), 30)
        finally:
            await api.platform.close_loop()  # (as the app's shutdown: this loop's connections closed)

    done = asyncio.run(one())
    assert (done.job.name, done.replayed, groups.groups) == ("next", False, 1)


def test_a_request_gone_while_its_submission_waits_is_not_written(api, monkeypatch):
    """The client went away (its request cancelled) before its submission's group was written:
    nothing of it is written; the others of the group are."""
    from hai.api.jobs import SubmissionGroups

    groups = SubmissionGroups()
    real = SubmissionGroups._written
    release = asyncio.Event()

    async def held(platform, items):  # noqa: ANN001, ANN202 - the first group is written only once released
        await asyncio.wait_for(release.wait(), 30)
        return await real(platform, items)

    monkeypatch.setattr(SubmissionGroups, "_written", staticmethod(held))
    alice = _user(api, api.alice)

    async def scenario() -> list:
        first = asyncio.ensure_future(groups.submit(api.platform, (_spec("first"), alice, None)))
        await asyncio.sleep(0)  # (one turn of the loop: the writer has taken the first group)
        gone = asyncio.ensure_future(groups.submit(api.platform, (_spec("gone"), alice, None)))
        kept = asyncio.ensure_future(groups.submit(api.platform, (_spec("kept"), alice, None)))
        await asyncio.sleep(0)
        assert len(groups._waiting) == 2
        gone.cancel()
        release.set()
        try:
            return await asyncio.gather(first, kept)
        finally:
            await api.platform.close_loop()

    done = asyncio.run(scenario())
    assert [d.job.name for d in done] == ["first", "kept"]
    assert (groups.groups, groups.largest) == (2, 1)
    with api.platform.sessions() as s:
        assert sorted(s.scalars(select(Job.name))) == ["first", "kept"]


def _where_written(monkeypatch) -> list[str]:  # noqa: ANN001
    """Records, for each group written, whether it ran on an event loop or in a worker thread
    (``submit_group``), or as one statement on the loop without a Session (``submit_alone_on``)."""
    real, real_alone, where = submissions.submit_group, submissions.submit_alone_on, []

    def recording(**kw):  # noqa: ANN003, ANN202
        try:
            asyncio.get_running_loop()
            where.append("event loop")
        except RuntimeError:  # no loop running in this thread: a worker thread
            where.append("worker thread")
        return real(**kw)

    async def recording_alone(statements, **kw):  # noqa: ANN001, ANN003, ANN202
        asyncio.get_running_loop()  # (raises off a loop)
        where.append("event loop, one statement")
        return await real_alone(statements, **kw)

    real_group_on = submissions.submit_group_on

    async def recording_group_on(statements, **kw):  # noqa: ANN001, ANN003, ANN202
        asyncio.get_running_loop()
        where.append(f"event loop, one transaction of {len(kw['items'])}")
        return await real_group_on(statements, **kw)

    monkeypatch.setattr(submissions, "submit_group", recording)
    monkeypatch.setattr(submissions, "submit_alone_on", recording_alone)
    monkeypatch.setattr(submissions, "submit_group_on", recording_group_on)
    return where


def _submit_early(api: Api, body: dict) -> httpx.Response:
    api.client.get("/api/v1/jobs", params={"limit": 1}, headers=api.h(api.alice))  # the credential cached
    early = _early(api.client.app)
    before = early.answered
    r = api.client.post("/api/v1/jobs", json=body, headers=api.h(api.alice))
    assert early.answered == before + 1  # answered by the early path, through its group writer
    return r


def test_on_postgresql_a_group_is_written_on_the_event_loop_elsewhere_in_a_worker_thread(api, monkeypatch):
    """PostgreSQL (``db.submit_on_loop``, the default): the group writer runs the submission on the
    event loop through the loop's asyncio connections, no worker thread (a group of one: its one
    statement on the loop's statement connection, no Session); the same answer and rows as the
    thread gives. SQLite, or the setting off: a worker thread."""
    where = _where_written(monkeypatch)
    on_pg = api.platform.engine.dialect.name == "postgresql"
    r = _submit_early(api, {"name": "first", "command": ["true"], "gpus_per_node": 2})
    assert r.status_code == 201 and r.json()["name"] == "first" and r.json()["gpus_per_node"] == 2
    assert where == ["event loop, one statement" if on_pg else "worker thread"]
    monkeypatch.setattr(api.platform.settings.db, "submit_on_loop", False)
    r2 = _submit_early(api, {"name": "second", "command": ["true"], "gpus_per_node": 2})
    assert r2.status_code == 201 and where[1:] == ["worker thread"]
    assert set(r.json()) == set(r2.json())  # the same answer whichever way it was written
    with api.platform.sessions() as s:
        assert sorted(s.scalars(select(Job.name))) == ["first", "second"]
        assert s.scalar(select(func.count(JobEvent.id))) == 2


def test_a_refusal_and_a_replay_written_on_the_event_loop(api):
    """The loop's writer answers a refusal (422, 429) and a key's replay as the route does."""
    r = _submit_early(api, {"name": "big", "command": ["true"], "nodes": 3})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "nodes"
    h = api.h(api.alice) | {"Idempotency-Key": "key-1"}
    first = api.client.post("/api/v1/jobs", json={"name": "k", "command": ["true"]}, headers=h)
    again = api.client.post("/api/v1/jobs", json={"name": "k", "command": ["true"]}, headers=h)
    assert (first.status_code, again.status_code) == (201, 200) and first.json()["id"] == again.json()["id"]
    other = api.client.post("/api/v1/jobs", json={"name": "other", "command": ["true"]}, headers=h)
    assert other.status_code == 422 and "Idempotency-Key" in other.text
    with api.platform.sessions() as s:
        assert list(s.scalars(select(Job.name))) == ["k"]


def test_a_dead_idle_connection_of_the_loop_is_replaced(pg_url, tmp_path, monkeypatch):
    """PostgreSQL: the loop's connection killed by the server while idle (a restart, an idle
    timeout): the next submission pings it on checkout, gets a new one, and is written."""
    from sqlalchemy import text

    from hai.db import session as db_session

    with api_with_two_nodes(pg_url, tmp_path) as api:
        assert _submit_early(api, {"name": "before", "command": ["true"]}).status_code == 201
        monkeypatch.setattr(db_session, "PING_AFTER_IDLE_S", 0.0)  # every checkout pings (as after an idle second)
        with api.platform.engine.connect() as conn:  # every other backend of this database: the loop's included
            killed = conn.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")).scalar_one()
        assert killed >= 1
        (_engine, _sessions, statements), = api.platform._loop_engines.values()
        assert statements.connects == 1
        r = _submit_early(api, {"name": "after", "command": ["true"]})
        assert r.status_code == 201, r.text
        assert statements.connects == 2  # the statement connection pinged, found dead, replaced
        with api.platform.sessions() as s:
            assert sorted(s.scalars(select(Job.name))) == ["after", "before"]


def test_the_loops_connections_are_closed_when_the_app_stops(pg_url, tmp_path):
    """The lifespan's end closes the loop's statement connection and disposes the loop's engine:
    its connections are closed, not left to the garbage collector."""
    with api_with_two_nodes(pg_url, tmp_path) as api:
        assert _submit_early(api, {"name": "one", "command": ["true"]}).status_code == 201
        (engine, _sessions, statements), = api.platform._loop_engines.values()
        held = statements._held.driver_connection
        # the statement connection, held by the loop (in autocommit), not in the pool
        assert engine.sync_engine.pool.checkedout() == 1 and held.autocommit and not held.closed
        _submit_early(api, {"name": "too-big", "command": ["true"], "nodes": 3})  # refused: through a Session
        assert engine.sync_engine.pool.checkedin() == 1  # the Session's connection, back in the pool
    assert held.closed
    assert engine.sync_engine.pool.checkedin() == 0 and engine.sync_engine.pool.checkedout() == 0
    assert not api.platform._loop_engines


def _held_connection_waits_on_a_lock(api: Api) -> bool:
    """Whether the event loop's held statement connection exists and its backend waits on a lock
    (``pg_stat_activity``): a statement of it held by another transaction's uncommitted row."""
    from sqlalchemy import text

    if not api.platform._loop_engines:
        return False
    (_e, _s, statements), = api.platform._loop_engines.values()
    if statements._held is None:
        return False
    with api.platform.engine.connect() as conn:
        return conn.execute(text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :p"),
                            {"p": statements._held.driver_connection.info.backend_pid}).scalar() is True


def _racing_an_uncommitted_key(api: Api, write) -> tuple[object, object, int]:  # noqa: ANN001
    """Another transaction writes alice's job "same" with key "k" and does not commit; ``write()``
    (a coroutine of the API's writer) starts on a fresh event loop; once the loop's statement
    connection waits on that key's lock (``pg_stat_activity``) the other commits. Returns the
    other's submission, what ``write`` answered, and the connections the loop's statement
    connection took."""
    other = api.platform.sessions()
    other.connection()  # a transaction of its own
    theirs = submissions._submit(session=other, spec=_spec("same"), user=_user(api, api.alice), limits=LIMITS,
                                 idempotency_key="k", commit=False)  # the job and its key written, not committed

    async def scenario():  # noqa: ANN202
        mine = asyncio.ensure_future(write())
        try:
            await _until(lambda: _held_connection_waits_on_a_lock(api),
                         "the statement waiting on the other transaction's key")
            other.commit()
            out = await mine
            (_e, _s, statements), = api.platform._loop_engines.values()
            return out, statements.connects
        finally:
            await api.platform.close_loop()

    try:
        out, connects = asyncio.run(scenario())
    finally:
        other.close()
    return theirs, out, connects


def test_on_postgresql_a_key_committed_while_the_statement_waits_is_answered_with_its_job(pg_url, tmp_path):
    """A group of one on the loop's statement connection (no Session) meets a key that another
    transaction wrote and has not committed: PostgreSQL holds the statement on the unique index,
    the other commits, the statement fails (a real unique violation, raised as SQLAlchemy's
    IntegrityError); the submission is then answered through a Session: the other's job, replayed."""
    with api_with_two_nodes(pg_url, tmp_path) as api:
        alice = _user(api, api.alice)
        groups = EarlySubmissions(None, owner=None).grouped
        theirs, done, connects = _racing_an_uncommitted_key(
            api, lambda: groups.submit(api.platform, (_spec("same"), alice, "k")))
        assert done.replayed and done.job.id == theirs.job.id and done.job.name == "same"
        assert connects == 1  # an IntegrityError is no disconnect: the connection kept
        with api.platform.sessions() as s:
            assert s.scalar(select(func.count(Job.id))) == 1
            assert s.scalar(select(func.count(IdempotencyKey.key))) == 1


def _written_on_the_loop(api: Api, items: list[submissions.Single]) -> tuple[list, int]:
    """``SubmissionGroups._written`` of ``items`` as one group on a fresh event loop (as the API's
    writer calls it for that many requests in flight): the answers, and the connections the loop's
    statement connection took."""
    from hai.api.jobs import SubmissionGroups

    async def scenario():  # noqa: ANN202
        try:
            out = await SubmissionGroups._written(api.platform, items)
            (_e, _s, statements), = api.platform._loop_engines.values()
            return out, statements.connects
        finally:
            await api.platform.close_loop()

    return asyncio.run(scenario())


def test_on_postgresql_a_group_is_one_pipelined_transaction_without_a_session_answered_as_alone(pg_url, tmp_path,
                                                                                                 monkeypatch):
    """PostgreSQL: a group of several written on the loop's statement connection, no Session: the
    same answers, rows and keys as each submission alone, one after another (refusals and replays,
    which depend on those before them in the group, answered through a Session after the group's
    commit), and every job the group wrote in one transaction."""
    from sqlalchemy import text

    with api_with_two_nodes(pg_url, tmp_path) as api:
        monkeypatch.setattr(api.platform.settings, "limits", LIMITS)
        items = _items(api)
        alone = []
        for spec, user, key in items:
            with api.platform.sessions() as s:
                try:
                    alone.append(submissions.submit(session=s, spec=spec, user=user, limits=LIMITS,
                                                    idempotency_key=key))
                except (Invalid, TooMany) as exc:
                    alone.append(exc)
        stored_alone = _stored(api)
        _clear(api)

        where = _where_written(monkeypatch)
        grouped, connects = _written_on_the_loop(api, items)

        assert _answers(grouped) == _answers(alone)
        assert grouped[3].job.id == grouped[2].job.id  # k1's replay: the job written earlier in the group
        assert f"used with another request body (job {grouped[2].job.id})" in str(grouped[4])
        assert _stored(api) == stored_alone
        # the group's statements, then the five not written (422, 200, 422, 429, 429) each through a Session
        assert where == ["event loop, one transaction of 10"] + ["event loop"] * 5
        assert connects == 1
        with api.platform.engine.connect() as conn:  # the five jobs written by one transaction
            assert conn.execute(text("SELECT count(DISTINCT xmin::text) FROM jobs")).scalar_one() == 1
            assert conn.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 5


def test_on_postgresql_a_key_committed_while_a_group_waits_rolls_it_back_and_sends_each_alone(pg_url, tmp_path):
    """A group on the loop's statement connection meets a key another transaction wrote and has
    not committed: its statement waits on the unique index; the other commits; the unique
    violation rolls the whole group back (none of it written twice), and each is then submitted
    alone: the key's submission answered with the other's job, the rest written. The connection
    is kept (an IntegrityError is no disconnect)."""
    from hai.api.jobs import SubmissionGroups

    with api_with_two_nodes(pg_url, tmp_path) as api:
        alice = _user(api, api.alice)
        items = [(_spec("before"), alice, None), (_spec("same"), alice, "k"), (_spec("after"), alice, None)]
        theirs, out, connects = _racing_an_uncommitted_key(
            api, lambda: SubmissionGroups._written(api.platform, items))
        assert [(o.job.name, o.replayed) for o in out] == [("before", False), ("same", True), ("after", False)]
        assert out[1].job.id == theirs.job.id
        assert connects == 1
        with api.platform.sessions() as s:
            assert sorted(s.scalars(select(Job.name))) == ["after", "before", "same"]
            assert s.scalar(select(func.count(JobEvent.id))) == 3


def test_on_postgresql_a_group_whose_connection_dies_writes_none_of_it_and_the_next_reconnects(pg_url, tmp_path):
    """The loop's statement connection killed by the server before a group is sent (and not yet
    idle long enough to be pinged): the group fails as a whole with the disconnect (the API answers
    503), nothing of it written; the connection is dropped, and the next group takes another."""
    from sqlalchemy import text

    with api_with_two_nodes(pg_url, tmp_path) as api:
        alice = _user(api, api.alice)

        async def scenario():  # noqa: ANN202
            from hai.api.jobs import SubmissionGroups

            try:
                first = await SubmissionGroups._written(api.platform, [(_spec("one"), alice, None),
                                                                       (_spec("two"), alice, None)])
                (_e, _s, statements), = api.platform._loop_engines.values()
                with api.platform.engine.connect() as conn:
                    conn.execute(text("SELECT pg_terminate_backend(:p)"),
                                 {"p": statements._held.driver_connection.info.backend_pid})
                lost = await SubmissionGroups._written(api.platform, [(_spec("lost1"), alice, None),
                                                                      (_spec("lost2"), alice, None)])
                dropped = statements._held is None
                again = await SubmissionGroups._written(api.platform, [(_spec("three"), alice, None),
                                                                       (_spec("four"), alice, None)])
                return first, lost, dropped, again, statements.connects
            finally:
                await api.platform.close_loop()

        first, lost, dropped, again, connects = asyncio.run(scenario())
        assert [o.job.name for o in first] == ["one", "two"]
        assert all(isinstance(o, OperationalError) and o.connection_invalidated for o in lost)
        assert dropped
        assert [o.job.name for o in again] == ["three", "four"]
        assert connects == 2
        with api.platform.sessions() as s:
            assert sorted(s.scalars(select(Job.name))) == ["four", "one", "three", "two"]
