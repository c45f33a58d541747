"""The platform on PostgreSQL with Redis: the same services, the leader lock, cross-process
wake-ups, and a real Celery worker."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from hai.db.base import utcnow
from hai.db.migrate import upgrade
from hai.db.models import Node
from hai.main import create_app
from hai.services.context import Platform
from hai.services.notify import RedisNotifier
from hai.services.runner import SchedulerLoop
from hai.settings import Settings
from tests.conftest import Api

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pg_platform(pg_url, redis_url, tmp_path):
    upgrade(pg_url)
    settings = Settings(data_dir=tmp_path, db={"url": pg_url}, redis={"url": redis_url}, frontend_dist=tmp_path / "none")
    p = Platform.from_settings(settings)
    yield p
    p.close()


@pytest.fixture
def celery_worker(pg_url, redis_url, tmp_path):
    """A real Celery worker (solo pool) on a queue of its own, against this test's database and
    Redis; yields the queue. Tasks sent from the test process go through the same Redis."""
    from hai.settings import get_settings

    env = {**os.environ, "HAI_DB__URL": pg_url, "HAI_REDIS__URL": redis_url, "HAI_DATA_DIR": str(tmp_path)}
    queue = f"hai-it-{os.getpid()}-{tmp_path.name}"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "hai.tasks", "worker", "-Q", queue, "--pool", "solo", "--loglevel", "WARNING"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    os.environ["HAI_REDIS__URL"] = redis_url
    get_settings.cache_clear()
    try:
        yield queue
    finally:
        os.environ.pop("HAI_REDIS__URL", None)
        get_settings.cache_clear()
        worker.terminate()
        worker.wait(30)


def test_job_lifecycle_on_postgresql(pg_platform):
    from tests.api.test_agent_protocol_api import cycle, exited, heartbeat, running

    with TestClient(create_app(pg_platform)) as client:
        api = Api(client, pg_platform)
        assert client.get("/healthz").json()["database"] == "postgresql"
        api.register_node("p0", zone="A", leaf="A1")
        api.register_node("p1", zone="A", leaf="A2")
        j = api.submit(nodes=2, name="pg")
        assert cycle(api).started == [j["id"]]
        heartbeat(api, "p0", [running(j["id"], 1, [0])])
        heartbeat(api, "p1", [running(j["id"], 1, [1])])
        heartbeat(api, "p0", [exited(j["id"], 1, {0: 0})])
        heartbeat(api, "p1", [exited(j["id"], 1, {1: 0})])
        body = api.get(f"/api/v1/jobs/{j['id']}").json()
        assert body["state"] == "succeeded"
        assert [e["to_state"] for e in body["events"]] == ["queued", "starting", "running", "succeeded"]
        # a rejected request writes nothing on PostgreSQL either
        r = api.post("/api/v1/jobs", json={"name": "x", "command": ["true"], "nodes": 3})
        assert r.status_code == 422
        assert api.get("/api/v1/jobs").json()["total"] == 1


def test_only_one_scheduler_leads_at_a_time(pg_platform):
    first = SchedulerLoop(pg_platform)
    second_platform = Platform.from_settings(pg_platform.settings)
    second = SchedulerLoop(second_platform)
    t1 = first.start_thread()
    assert first.leading.wait(20)
    t2 = second.start_thread()
    # the second replica waits on the lock while the first runs cycles
    cycles_before = first.cycles
    pg_platform.notifier.publish("scheduler")
    assert not second.leading.wait(3)
    assert first.cycles >= cycles_before
    # the leader stops: the waiting replica takes over
    first.stop.set()
    t1.join(20)
    assert second.leading.wait(20)
    second.stop.set()
    t2.join(20)
    second_platform.close()


def test_redis_carries_wakeups_between_processes(redis_url):
    a, b = RedisNotifier(redis_url), RedisNotifier(redis_url)
    try:
        since = b.version("node:x")
        woke = threading.Event()

        def waiter():
            if b.wait("node:x", since, 20):
                woke.set()

        t = threading.Thread(target=waiter)
        t.start()
        a.publish("node:x")
        t.join(25)
        assert woke.is_set()
        assert a.version("node:x") == 1 and b.version("node:x") == 1
    finally:
        a.close()
        b.close()


def test_platforms_on_different_redis_databases_do_not_wake_each_other(redis_url):
    """Pub/sub ignores the database number; the channel is named after it. Ordering makes this
    deterministic: Redis queues a PUBLISH for every subscriber before it answers it, and ``b``
    receives on one connection in order, so once ``b`` has seen the marker (published after the
    other database's message was answered) that message would have arrived, had it been heard."""
    base, _, db = redis_url.rpartition("/")
    other_url = f"{base}/{(int(db) if db.isdigit() else 0) + 1}"
    a, b, a_twin = RedisNotifier(other_url), RedisNotifier(redis_url), RedisNotifier(redis_url)
    try:
        assert a.CHANNEL != b.CHANNEL == a_twin.CHANNEL
        since = b.version("marker")
        a.publish("node:x")  # the other database: b must not hear it
        a_twin.publish("marker")  # b's own database, published after it
        assert b.wait("marker", since, 20)
        assert b.version("node:x") == 0
    finally:
        a.close()
        b.close()
        a_twin.close()


def test_celery_worker_reaps_silent_nodes(pg_platform, celery_worker):
    with pg_platform.sessions() as s:
        s.add(Node(name="silent", gpus=8, last_heartbeat_at=utcnow() - timedelta(hours=1)))
        s.add(Node(name="alive", gpus=8, last_heartbeat_at=utcnow()))
        s.commit()
    from hai.tasks import reap_lost_nodes

    result = reap_lost_nodes.apply_async(queue=celery_worker)
    assert result.get(timeout=120) == ["silent"]
    with pg_platform.sessions() as s:
        states = dict(s.execute(select(Node.name, Node.state)).all())
    assert states == {"silent": "lost", "alive": "ready"}
