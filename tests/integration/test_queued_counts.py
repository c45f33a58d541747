"""Each user's queued jobs kept by the database (issue 12, migrations 0018 and 0019): triggers on
``jobs`` append +1 / -1 rows to ``queued_counts`` whenever a job enters or leaves the queued
state (and the held part: +1 / -1 in ``held`` for a job its owner holds, a pair of rows when a
queued job is held or released), the submission's queued-jobs limit reads the user's sum, a
scheduling cycle the sum of the jobs not held, and the scheduler folds them into one row per
user (services/queued_counts). The sums must equal ``count(*)`` of the queued (and held) jobs
after every kind of write, folded or not, with writers running while it folds; on SQLite and
PostgreSQL."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, delete, func, select, text, update

from hai.db.base import utcnow
from hai.db.migrate import downgrade, upgrade
from hai.db.models import Job, QueuedCount
from hai.domain.jobs import JobState
from hai.services import queued_counts
from hai.services.jobs import requeue_as_restart, transition
from hai.services.leader import leadership
from hai.services.runner import SchedulerLoop
from hai.services.scheduling import _queued_and_demotable
from tests.conftest import Api, api_with_two_nodes


def _url(request, tmp_path) -> str:  # noqa: ANN001
    return f"sqlite:///{tmp_path / 'hai.db'}" if request.param.startswith("sqlite") else request.getfixturevalue("pg_url")


@pytest.fixture(params=["sqlite", "postgresql", "sqlite-create_all", "postgresql-create_all"])
def api(request, tmp_path):
    """An Api (users alice and bob, two 8-GPU nodes), queued-jobs limit 4, on a database built by
    the migrations, or by ``create_all`` as the other tests build theirs (its own copy of the
    triggers' DDL)."""
    with api_with_two_nodes(_url(request, tmp_path), tmp_path, create_all=request.param.endswith("create_all"),
                            limits={"max_queued_jobs_per_user": 4}) as a:
        yield a


def _kept(session) -> dict[int, tuple[int, int]]:  # noqa: ANN001
    rows = session.execute(select(QueuedCount.user_id, func.sum(QueuedCount.delta), func.sum(QueuedCount.held))
                           .group_by(QueuedCount.user_id))
    return {u: (int(n), int(h)) for u, n, h in rows if n or h}


def _counted(session) -> dict[int, tuple[int, int]]:  # noqa: ANN001
    rows = session.execute(select(Job.user_id, func.count(), func.count().filter(Job.user_suspended.is_(True)))
                           .where(Job.state == JobState.QUEUED.value).group_by(Job.user_id))
    return {u: (int(n), int(h)) for u, n, h in rows}


def _same(api: Api) -> dict[int, int]:
    """The kept counts (each user's queued and held jobs, and the queue's jobs not held as a
    scheduling cycle reads them) equal a count of the queue; returns each user's queued."""
    with api.platform.read_sessions() as s:
        kept, counted = _kept(s), _counted(s)
        ready = s.scalar(select(queued_counts.ready()))
        not_held = s.scalar(select(func.count()).select_from(Job).where(
            Job.state == JobState.QUEUED.value, Job.user_suspended.is_(False)))
        cycle_reads = _queued_and_demotable(s)[0]
    assert kept == counted
    assert ready == not_held == cycle_reads
    return {u: n for u, (n, _) in kept.items()}


def _write(api: Api, fn) -> None:  # noqa: ANN001
    with api.platform.sessions() as s:
        fn(s)
        s.commit()


def _held(api: Api) -> int:
    with api.platform.read_sessions() as s:
        return sum(h for _, h in _kept(s).values())


def _fold(api: Api) -> None:
    with api.platform.sessions() as s:
        queued_counts.fold(s)


def test_the_kept_counts_follow_every_way_a_job_enters_or_leaves_the_queue(api):
    ids = [api.submit(gpus_per_node=8, name=f"a{i}")["id"] for i in range(3)]
    ids += [api.submit(api.bob, gpus_per_node=8, name=f"b{i}")["id"] for i in range(2)]
    assert sorted(_same(api).values()) == [2, 3]
    r = api.post("/api/v1/jobs/batch", json={"jobs": [{"name": "b-batch", "command": ["true"], "gpus_per_node": 8}]},
                 token=api.bob)
    assert r.status_code == 201, r.text
    _same(api)

    loop = SchedulerLoop(api.platform)
    with leadership(api.platform, stop=threading.Event()) as lease:
        started = loop.cycle_once(lease).started  # two 8-GPU jobs start: they leave the queue
        assert len(started) == 2
        _same(api)
        queued = [i for i in ids if i not in started]
        api.post(f"/api/v1/jobs/{queued[0]}/cancel", api.admin).raise_for_status()
        _same(api)
        api.post(f"/api/v1/jobs/{queued[1]}/suspend", api.admin).raise_for_status()  # held: still queued
        assert _same(api) and _held(api) == 1
        _fold(api)
        assert _held(api) == 1
        api.post(f"/api/v1/jobs/{queued[1]}/resume", api.admin).raise_for_status()
        assert _same(api) and _held(api) == 0
        # held and released behind the application's back, and a held job cancelled
        _write(api, lambda s: s.execute(update(Job).where(Job.id.in_(queued[1:3])).values(user_suspended=True)))
        assert _same(api) and _held(api) == 2
        _write(api, lambda s: s.execute(update(Job).where(Job.id == queued[2]).values(user_suspended=False)))
        _write(api, lambda s: s.execute(update(Job).where(Job.id == queued[1]).values(state="cancelled")))
        assert _same(api) and _held(api) == 0
        _write(api, lambda s: s.execute(update(Job).where(Job.id == queued[1]).values(state="queued")))
        _write(api, lambda s: s.execute(update(Job).where(Job.id == queued[1]).values(user_suspended=False)))
        _same(api)

        def restart(s):  # noqa: ANN001  (a lost node's job back in the queue)
            requeue_as_restart(s, s.get(Job, started[0]), reason="node lost", pending_reason="requeued",
                               now=utcnow() + timedelta(seconds=1))
        _write(api, restart)
        _same(api)
        _fold(api)
        _same(api)

        def finish(s):  # noqa: ANN001
            job = s.get(Job, started[1])
            transition(s, job, JobState.SUCCEEDED, reason="done")
        _write(api, finish)
        # behind the application's back: raw SQL moves rows in and out, a queued row deleted
        _write(api, lambda s: s.execute(update(Job).where(Job.id == started[1]).values(state="queued")))
        _write(api, lambda s: s.execute(text("UPDATE jobs SET state = 'cancelled' WHERE id = :i"), {"i": queued[2]}))
        _write(api, lambda s: s.execute(delete(Job).where(Job.id == queued[1])))
        _write(api, lambda s: s.execute(update(Job).where(Job.id == started[1]).values(pending_reason="x")))
        _same(api)
        loop.cycle_once(lease)
        _same(api)
    _fold(api)
    kept = _same(api)
    with api.platform.read_sessions() as s:  # one row a user with jobs queued, none for the others
        assert s.scalar(select(func.count()).select_from(QueuedCount)) == len(kept)


def test_the_queue_limit_reads_the_kept_count(api):
    """The 429 says how many the user has, and a job that leaves the queue any way (here a raw
    UPDATE, as another process's write) frees its place at once, folded or not."""
    ids = [api.submit(name=f"j{i}", gpus_per_node=1)["id"] for i in range(4)]
    r = api.post("/api/v1/jobs", json={"name": "fifth", "command": ["true"], "gpus_per_node": 1})
    assert r.status_code == 429 and "you have 4 queued job(s)" in r.json()["detail"], r.text
    _fold(api)
    assert api.post("/api/v1/jobs", json={"name": "fifth", "command": ["true"]}).status_code == 429
    _write(api, lambda s: s.execute(update(Job).where(Job.id == ids[0]).values(state="cancelled")))
    assert api.post("/api/v1/jobs", json={"name": "fifth", "command": ["true"]}).status_code == 201
    r = api.post("/api/v1/jobs/batch", json={"jobs": [{"name": "b", "command": ["true"]}]})
    assert r.status_code == 429 and "you have 4 queued job(s)" in r.json()["detail"], r.text
    assert api.submit(api.bob, name="bob's", gpus_per_node=1)["state"] == "queued"  # per user
    _same(api)


def test_folding_while_others_write_loses_no_change(api):
    """Writers submit, cancel and requeue jobs in their own transactions while the scheduler's
    folding runs again and again: the kept counts still equal the queue's."""
    api.platform.settings.limits.max_queued_jobs_per_user = 0  # no limit: the writers' jobs pile up
    stop = threading.Event()
    errors: list[BaseException] = []
    folds = 0

    def folder() -> None:
        nonlocal folds
        try:
            while not stop.is_set():
                _fold(api)
                folds += 1
        except BaseException as exc:  # noqa: BLE001  (reported by the assertion below)
            errors.append(exc)

    def churn(s, n: int) -> None:  # noqa: ANN001
        jobs = list(s.scalars(select(Job).order_by(Job.id).limit(6).offset(n % 5)))
        for k, job in enumerate(jobs):
            state = JobState.QUEUED.value if job.state != JobState.QUEUED.value else ("running", "cancelled")[k % 2]
            s.execute(update(Job).where(Job.id == job.id).values(state=state, user_suspended=(n + k) % 3 == 0))

    t = threading.Thread(target=folder)
    t.start()
    try:
        for n in range(30):
            api.submit(api.alice if n % 2 else api.bob, name=f"w{n}", gpus_per_node=1)
            _write(api, lambda s, n=n: churn(s, n))
    finally:
        stop.set()
        t.join(60)
    assert not errors and folds > 0
    _same(api)
    _fold(api)
    _same(api)


def test_folding_waits_for_enough_rows_and_is_what_the_scheduler_loop_does(api):
    folding = queued_counts.Folding(every=5)
    assert folding.maybe(api.platform.sessions, api.platform.read_sessions) is False  # nothing there
    api.submit(name="one", gpus_per_node=1)
    assert folding.maybe(api.platform.sessions, api.platform.read_sessions) is True  # first time: folds
    for i in range(4):
        api.submit(api.bob if i % 2 else api.alice, name=f"b{i}", gpus_per_node=1)
    assert folding.maybe(api.platform.sessions, api.platform.read_sessions) is False  # 4 rows since
    api.submit(api.bob, name="b5", gpus_per_node=1)
    assert folding.maybe(api.platform.sessions, api.platform.read_sessions) is True
    with api.platform.read_sessions() as s:
        assert s.scalar(select(func.count()).select_from(QueuedCount)) == 2
    _same(api)
    loop = SchedulerLoop(api.platform)
    assert isinstance(loop.folding, queued_counts.Folding)


def _vacuums(api: Api) -> int:
    with api.platform.engine.connect() as c:
        return c.execute(text("SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'queued_counts'")).scalar_one()


@pytest.mark.parametrize("api", ["postgresql"], indirect=True)  # SQLite reuses a deleted row's space itself
def test_on_postgresql_each_fold_is_followed_by_a_vacuum(api):
    """The rows a fold deletes leave their index entries until a vacuum; each fold vacuums the
    table (the vacuum's count, which PostgreSQL 15 records as it ends), and a look that does not
    fold does not."""
    folding = queued_counts.Folding(every=3)
    api.submit(name="one", gpus_per_node=1)
    before = _vacuums(api)
    assert folding.maybe(api.platform.sessions) is True
    assert _vacuums(api) == before + 1
    api.submit(name="two", gpus_per_node=1)
    assert folding.maybe(api.platform.sessions) is False
    assert _vacuums(api) == before + 1
    for i in range(3):
        api.submit(api.bob, name=f"b{i}", gpus_per_node=1)
    assert folding.maybe(api.platform.sessions) is True
    assert _vacuums(api) == before + 2
    _same(api)


@pytest.fixture(params=["sqlite", "postgresql"])
def bare_url(request, tmp_path):
    return _url(request, tmp_path)


def test_the_upgrade_counts_the_jobs_already_queued(bare_url):
    """0018 and 0019 on a database with jobs: one row a user, the count of their queued jobs
    and of those held; the triggers there keep them from then on; a downgrade to 0018 keeps the
    counts of queued jobs without the held ones, and one to 0017 removes table and triggers."""
    upgrade(bare_url, "0017")
    engine = create_engine(bare_url)
    now = utcnow()
    with engine.begin() as c:
        for uid, name in ((1, "u1"), (2, "u2"), (3, "u3")):
            c.execute(text("INSERT INTO users (id, name, \"group\", is_admin, created_at) "
                           "VALUES (:i, :n, 'g', false, :t)"), {"i": uid, "n": name, "t": now})
        rows = [(1, "queued", False)] * 3 + [(1, "running", False), (2, "queued", False), (2, "queued", True),
                                             (2, "running", True), (3, "succeeded", False)]
        for k, (uid, state, held) in enumerate(rows):
            c.execute(text(
                "INSERT INTO jobs (name, user_id, user_name, \"group\", command, env, tags, job_type, nodes,"
                " gpus_per_node, priority, submitted_priority, allow_cross_zone, suspend_grace_s, state, created_at,"
                " queued_at, attempt, suspensions, restarts, reserved_nodes, desired_action, user_suspended,"
                " lost_gpu_s, run_s) VALUES (:n, :u, :un, 'g', '[]', '{}', '[]', 'command', 1, 1, 'NORMAL', 'NORMAL',"
                " false, 60, :s, :t, :t, 0, 0, 0, '[]', 'run', :h, 0, 0)"),
                {"n": f"j{k}", "u": uid, "un": f"u{uid}", "s": state, "t": now, "h": held})
    upgrade(bare_url, "0018")
    with engine.begin() as c:
        assert sorted(c.execute(text("SELECT user_id, delta FROM queued_counts")).all()) == [(1, 3), (2, 2)]
    upgrade(bare_url)
    sums = text("SELECT user_id, sum(delta), sum(held) FROM queued_counts GROUP BY user_id")
    with engine.begin() as c:
        assert {u: (int(n), int(h)) for u, n, h in c.execute(sums)} == {1: (3, 0), 2: (2, 1)}
        c.execute(text("UPDATE jobs SET state = 'queued' WHERE user_id = 3"))
        c.execute(text("UPDATE jobs SET user_suspended = true WHERE user_id = 1 AND state = 'queued'"))
        assert {u: (int(n), int(h)) for u, n, h in c.execute(sums)} == {1: (3, 3), 2: (2, 1), 3: (1, 0)}
    engine.dispose()
    downgrade(bare_url, "0018")
    engine = create_engine(bare_url)
    with engine.begin() as c:
        assert "held" not in {col["name"] for col in engine.dialect.get_columns(c, "queued_counts")}
        c.execute(text("UPDATE jobs SET user_suspended = false, state = 'cancelled' WHERE user_id = 2"))
        assert dict(c.execute(text("SELECT user_id, sum(delta) FROM queued_counts GROUP BY user_id")).all()) == \
            {1: 3, 2: 0, 3: 1}
    engine.dispose()
    downgrade(bare_url, "0017")
    engine = create_engine(bare_url)
    with engine.begin() as c:
        c.execute(text("UPDATE jobs SET state = 'cancelled' WHERE user_id = 1"))  # no trigger left to fail
        assert "queued_counts" not in set(engine.dialect.get_table_names(c))
    engine.dispose()
