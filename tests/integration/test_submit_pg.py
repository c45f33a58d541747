"""POST /api/v1/jobs on SQLite and PostgreSQL (issue 12, fourth pass): on PostgreSQL the
admission checks and the writes are one statement (services/jobs._one_statement) run in
autocommit; these tests hold both databases to the same answers, refusals (nothing written) and
idempotency, and check that a submission with a cached credential is one statement on
PostgreSQL and, on SQLite, statements run on the driver's cursor."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, func, select

from hai.db.migrate import upgrade
from hai.db.models import ApiToken, IdempotencyKey, Job, JobEvent
from hai.main import create_app
from hai.services.context import Platform
from hai.settings import Settings
from tests.conftest import Api

BODY = {"name": "ci", "command": ["echo", "hi"], "gpus_per_node": 1}


@pytest.fixture(params=["sqlite", "postgresql"])
def make_api(request, tmp_path):
    """``make_api(**settings)``: an Api (TestClient, users alice and bob) on a migrated database."""
    url = f"sqlite:///{tmp_path / 'hai.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    upgrade(url)
    made = []

    def make(**settings) -> Api:  # noqa: ANN003
        s = Settings(data_dir=tmp_path / "hai", frontend_dist=tmp_path / "none", db={"url": url}, **settings)
        platform = Platform.from_settings(s)
        client = TestClient(create_app(platform)).__enter__()
        made.append((client, platform))
        return Api(client, platform)

    yield make
    for client, platform in made:
        client.__exit__(None, None, None)
        platform.close()


def _counts(api: Api) -> tuple[int, int, int]:
    with api.platform.sessions() as s:
        return (s.scalar(select(func.count(Job.id))), s.scalar(select(func.count(JobEvent.id))),
                s.scalar(select(func.count(IdempotencyKey.id))))


def _post(api: Api, body: dict, key: str | None = None, token: str | None = None):
    headers = api.h(token or api.alice) | ({"Idempotency-Key": key} if key else {})
    return api.client.post("/api/v1/jobs", json=body, headers=headers)


def test_a_submission_writes_the_job_and_its_event(make_api):
    api = make_api()
    api.register_node("n0")
    r = _post(api, BODY | {"env": {"A": "1"}, "tags": ["t"], "priority": "HIGH"})
    assert r.status_code == 201, r.text
    job = r.json()
    assert (job["state"], job["user"], job["group"], job["priority"], job["nodes"], job["gpus_per_node"]) == (
        "queued", "alice", "vision", "HIGH", 1, 1)
    assert job["env"] == {"A": "1"} and job["tags"] == ["t"] and job["placement"] == []
    assert [(e["from_state"], e["to_state"], e["reason"]) for e in job["events"]] == [(None, "queued", "submitted")]
    assert _counts(api) == (1, 1, 0)
    # what was written is what was answered, and the defaults of the columns not sent are there
    read = api.get(f"/api/v1/jobs/{job['id']}").json()
    assert read == job
    with api.platform.sessions() as s:
        row = s.get(Job, job["id"])
        assert (row.attempt, row.restarts, row.suspensions, row.reserved_nodes, row.desired_action,
                row.user_suspended, row.run_s, row.pending_reason) == (0, 0, 0, [], "run", False, 0.0,
                                                                       "waiting for the scheduler")
        assert row.events[0].at == row.created_at == row.queued_at


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"nodes": 3, "gpus_per_node": 8}, "nodes", "the cluster has 2 node(s); the job asks for 3"),
        ({"gpus_per_node": 8}, "gpus_per_node", "the largest node has 6 GPUs; the job asks for 8"),
        ({"nodes": 2, "gpus_per_node": 4}, "gpus_per_node",
         "a job of more than one node takes whole nodes: the cluster has 1 node(s) of 4 GPUs (node sizes: 4, 6)"),
    ],
)
def test_a_job_no_placement_fits_is_422_and_writes_nothing(make_api, body, field, message):
    api = make_api()
    api.register_node("n0", gpus=4)
    api.register_node("n1", gpus=6)
    r = _post(api, BODY | body, key="k")
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"][-1] == field and detail["msg"] == message
    assert _counts(api) == (0, 0, 0)
    assert _post(api, BODY, key="k").status_code == 201  # the refused request did not bind the key


def test_the_queued_jobs_limit_is_429_and_writes_nothing(make_api):
    api = make_api(limits={"max_queued_jobs_per_user": 2})
    api.register_node("n0")
    assert [_post(api, BODY).status_code for _ in range(2)] == [201, 201]
    r = _post(api, BODY)
    assert r.status_code == 429, r.text
    assert "you have 2 queued job(s)" in r.json()["detail"] and "MAX_QUEUED_JOBS_PER_USER=2" in r.json()["detail"]
    assert _counts(api) == (2, 2, 0)
    assert _post(api, BODY, token=api.bob).status_code == 201  # per user
    first = api.get("/api/v1/jobs", params={"user": "alice"}).json()["items"][0]["id"]
    assert api.post(f"/api/v1/jobs/{first}/cancel").status_code == 200
    assert _post(api, BODY).status_code == 201  # a cancelled job frees a place


def test_no_queued_jobs_limit(make_api):
    api = make_api(limits={"max_queued_jobs_per_user": 0})
    api.register_node("n0")
    assert {_post(api, BODY).status_code for _ in range(3)} == {201}
    assert _counts(api) == (3, 3, 0)


def test_idempotency_keys_replay_and_refuse_another_body(make_api):
    api = make_api()
    api.register_node("n0")
    first = _post(api, BODY, key="k-1")
    again = _post(api, BODY, key="k-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    other = _post(api, BODY | {"name": "other"}, key="k-1")
    assert other.status_code == 422 and "another request body" in other.json()["detail"][0]["msg"]
    assert _post(api, BODY, key="k-1", token=api.bob).status_code == 201  # keys are per user
    assert _counts(api) == (2, 2, 2)


def test_concurrent_submissions_with_one_key_make_one_job(make_api):
    api = make_api()
    api.register_node("n0")
    codes, ids = [], []

    def post() -> None:
        r = _post(api, BODY, key="same")
        codes.append(r.status_code)
        ids.append(r.json()["id"])

    threads = [threading.Thread(target=post) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200] * 5 + [201], codes
    assert len(set(ids)) == 1
    assert _counts(api) == (1, 1, 1)


@pytest.mark.parametrize("make_api", ["postgresql"], indirect=True)  # SQLite keeps its statements
@pytest.mark.parametrize("on_loop", [True, False])
def test_on_postgresql_a_submission_is_one_statement_in_autocommit(make_api, monkeypatch, on_loop):
    """With the credential cached: no BEGIN, one statement, no COMMIT of its own (one round
    trip). Seen at the driver (psycopg's cursor and connection, asyncio ones where the submission
    is written on the event loop, ``db.submit_on_loop``), where the statement runs: it skips
    SQLAlchemy's execution (hai.db.direct)."""
    import psycopg

    api = make_api()
    monkeypatch.setattr(api.platform.settings.db, "submit_on_loop", on_loop)
    assert api.platform.engine.dialect.name == "postgresql"
    api.register_node("n0")
    assert _post(api, BODY).status_code == 201  # the credential is now cached
    # the early path's writer: its connection made (a new engine's first connect asks the server a few things)
    assert _post(api, BODY).status_code == 201
    seen: list[tuple[str, bool, bool]] = []  # (statement, autocommit, on an asyncio connection)
    execute, commit = psycopg.Cursor.execute, psycopg.Connection.commit

    def _execute(cursor, query, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append((str(query).split()[0], cursor.connection.autocommit, False))
        return execute(cursor, query, *args, **kwargs)

    def _commit(conn):  # noqa: ANN001, ANN202
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:  # else psycopg sends nothing
            seen.append(("COMMIT", conn.autocommit, False))
        return commit(conn)

    async_execute, async_commit = psycopg.AsyncCursor.execute, psycopg.AsyncConnection.commit

    async def _async_execute(cursor, query, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append((str(query).split()[0], cursor.connection.autocommit, True))
        return await async_execute(cursor, query, *args, **kwargs)

    async def _async_commit(conn):  # noqa: ANN001, ANN202
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            seen.append(("COMMIT", conn.autocommit, True))
        return await async_commit(conn)

    monkeypatch.setattr(psycopg.Cursor, "execute", _execute)
    monkeypatch.setattr(psycopg.Connection, "commit", _commit)
    monkeypatch.setattr(psycopg.AsyncCursor, "execute", _async_execute)
    monkeypatch.setattr(psycopg.AsyncConnection, "commit", _async_commit)
    r = _post(api, BODY, key="k")
    monkeypatch.undo()
    assert r.status_code == 201, r.text
    assert seen == [("WITH", True, on_loop)]
    assert _counts(api) == (3, 3, 1)


@pytest.mark.parametrize("make_api", ["sqlite"], indirect=True)
def test_on_sqlite_a_submission_is_its_statements_on_the_driver(make_api):
    """SQLite: with the credential cached, one transaction under the write lock: the key's
    earlier use, the admission's figures, the job, its event and its key, committed; the five
    statements run on the driver's cursor (hai.db.direct), only the BEGIN through SQLAlchemy's
    execution. Seen by SQLite itself (its trace callback) and by SQLAlchemy's cursor event."""
    api = make_api()
    api.register_node("n0")
    assert _post(api, BODY).status_code == 201  # the credential is now cached
    engine = api.platform.engine
    seen: list[str] = []  # what SQLite ran
    through: list[str] = []  # what SQLAlchemy's execution ran

    def _trace(dbapi_conn, _record, _proxy) -> None:  # noqa: ANN001
        dbapi_conn.set_trace_callback(lambda sql: seen.append(" ".join(sql.split()[:3])))

    def _untrace(dbapi_conn, _record) -> None:  # noqa: ANN001
        dbapi_conn.set_trace_callback(None)

    def _through(_conn, _cursor, statement, _params, _context, _many) -> None:  # noqa: ANN001
        through.append(statement)

    event.listen(engine, "checkout", _trace)
    event.listen(engine, "checkin", _untrace)
    event.listen(engine, "before_cursor_execute", _through)
    try:
        r = _post(api, BODY, key="k")
    finally:
        event.remove(engine, "checkout", _trace)
        event.remove(engine, "checkin", _untrace)
        event.remove(engine, "before_cursor_execute", _through)
    assert r.status_code == 201, r.text
    # (SQLite traces the start of each trigger the INSERT fires with the INSERT's own text again)
    ran = [s for i, s in enumerate(seen) if not s.startswith("ROLLBACK") and (i == 0 or s != seen[i - 1])]
    assert ran == [
        "BEGIN IMMEDIATE", "SELECT idempotency_keys.job_id, idempotency_keys.request_hash", "SELECT coalesce(sum(node_sizes.nodes), 0)",
        "INSERT INTO jobs", "INSERT INTO job_events", "INSERT INTO idempotency_keys", "COMMIT"]
    assert through == ["BEGIN IMMEDIATE"]
    assert _counts(api) == (2, 2, 1)
    job = api.get(f"/api/v1/jobs/{r.json()['id']}").json()
    assert job["state"] == "queued" and job["created_at"] == r.json()["created_at"]
    assert [e["reason"] for e in job["events"]] == ["submitted"]


def test_a_token_looked_up_in_the_submission_commits_with_it(make_api):
    """No credential cache: the token's look-up and its last-used write share the submission's
    transaction (on PostgreSQL the one statement then runs inside it, not in autocommit)."""
    api = make_api(auth={"token_cache_s": 0})
    api.register_node("n0")
    r = _post(api, BODY)
    assert r.status_code == 201, r.text
    with api.platform.sessions() as s:
        used = s.scalars(select(ApiToken.last_used_at).where(ApiToken.user_id.is_not(None))).all()
    assert any(u is not None for u in used)
    assert _counts(api) == (1, 1, 0)


# -- POST /api/v1/jobs/batch on both databases (issue 12) ---------------------------------
def _batch(api: Api, jobs: list[dict], key: str | None = None):
    headers = api.h(api.alice) | ({"Idempotency-Key": key} if key else {})
    return api.client.post("/api/v1/jobs/batch", json={"jobs": jobs}, headers=headers)


def test_a_batch_writes_its_jobs_in_order_as_single_submissions_would(make_api):
    api = make_api()
    api.register_node("n0")
    jobs = [BODY | {"name": f"j{i}", "env": {"I": str(i)}, "gpus_per_node": 1 + i % 2} for i in range(50)]
    r = _batch(api, jobs)
    assert r.status_code == 201, r.text
    got = r.json()["jobs"]
    assert [(j["name"], j["env"], j["gpus_per_node"]) for j in got] == [
        (b["name"], b["env"], b["gpus_per_node"]) for b in jobs]
    assert [j["id"] for j in got] == sorted({j["id"] for j in got})
    # what was written is what was answered
    for j in (got[0], got[25], got[-1]):
        assert api.get(f"/api/v1/jobs/{j['id']}").json() == j
    single = _post(api, BODY).json()
    differ = {k for k in single if got[0][k] != single[k]}
    assert set(got[0]) == set(single) and differ <= {"id", "name", "env", "created_at", "events"}
    assert [e["reason"] for e in got[0]["events"]] == [e["reason"] for e in single["events"]] == ["submitted"]
    assert _counts(api) == (51, 51, 0)


def test_a_batch_with_a_job_that_cannot_fit_writes_nothing(make_api):
    api = make_api()
    api.register_node("n0", gpus=4)
    r = _batch(api, [BODY, BODY | {"gpus_per_node": 8}])
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "jobs", 1, "gpus_per_node"]
    assert _counts(api) == (0, 0, 0)


def test_a_batch_over_the_queued_jobs_limit_writes_nothing(make_api):
    api = make_api(limits={"max_queued_jobs_per_user": 3})
    api.register_node("n0")
    assert _post(api, BODY).status_code == 201
    assert _batch(api, [BODY] * 3).status_code == 429
    assert _counts(api) == (1, 1, 0)
    assert _batch(api, [BODY] * 2).status_code == 201
    assert _counts(api) == (3, 3, 0)


def test_concurrent_batches_with_one_key_make_one_batch(make_api):
    api = make_api()
    api.register_node("n0")
    jobs = [BODY | {"name": f"j{i}"} for i in range(20)]
    codes, ids = [], []

    def post() -> None:
        r = _batch(api, jobs, key="sweep")
        codes.append(r.status_code)
        ids.append(tuple(j["id"] for j in r.json()["jobs"]))

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200] * 3 + [201], codes
    assert len(set(ids)) == 1 and len(ids[0]) == 20
    assert _counts(api) == (20, 20, 20)


@pytest.mark.parametrize("make_api", ["postgresql"], indirect=True)  # SQLite: multi-row INSERTs
def test_on_postgresql_a_batch_is_its_checks_and_one_statement(make_api):
    """200 jobs of two sizes: the cluster's figures per size (the first with the user's queued
    jobs), then the jobs and their events as one statement over a JSON document."""
    api = make_api()
    api.register_node("n0")
    assert _post(api, BODY).status_code == 201  # the credential is now cached
    seen: list[str] = []

    @event.listens_for(api.platform.engine, "before_cursor_execute")
    def _seen(_conn, _cursor, statement, _params, _context, _many):  # noqa: ANN001
        seen.append(" ".join(statement.split()[:2]))

    r = _batch(api, [BODY | {"name": f"j{i}", "gpus_per_node": 1 + i % 2} for i in range(200)])
    event.remove(api.platform.engine, "before_cursor_execute", _seen)
    assert r.status_code == 201, r.text
    assert [s.split()[0] for s in seen] == ["SELECT", "SELECT", "WITH"], seen
    assert _counts(api) == (201, 201, 0)

