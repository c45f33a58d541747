"""Steady heartbeats are answered from the API process's reply cache (issue 12), and a change
made by another process (the scheduler, another API replica) reaches that cache through Redis
at once: PostgreSQL + Redis, two platforms standing for two processes."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from hai.db.models import Node
from hai.main import create_app
from hai.protocol import AgentHello, AttemptStatus, GpuInfo, GpuMetrics, Heartbeat, RankStatus
from hai.schemas.jobs import JobCreate
from hai.services import auth, notify
from hai.services import jobs as job_service
from hai.services.scheduling import run_cycle
from tests.integration.conftest import pg_url, redis_url, replicas, server_db_url  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration


@pytest.fixture
def two(replicas):  # noqa: ANN001, ANN201
    return replicas(2, validation={"quick_every_heartbeats": 0})


def test_steady_heartbeats_hit_the_cache_and_a_change_elsewhere_invalidates_it(two):
    api_platform, other = two
    node = f"cache-{uuid.uuid4().hex[:8]}"  # the Redis channel is shared: a name nobody else publishes
    with other.sessions() as s:
        agent_token = auth.create_agent_token(session=s)
        user, _ = auth.create_user(session=s, name="alice", group="g")
        alice = auth.Principal(kind="user", user_id=user.id, name="alice", group="g")
    app = create_app(api_platform)
    with TestClient(app) as client:
        h = {"Authorization": f"Bearer {agent_token}"}
        hello = AgentHello(node=node, address="127.0.0.1", zone="A", leaf="A1", fake_gpus=True,
                           gpus=[GpuInfo(index=i, uuid=f"G{i}", model="Fake", memory_total_mib=1) for i in range(2)])
        assert client.post("/api/v1/agent/register", json=hello.model_dump(mode="json"), headers=h).status_code == 200
        topic = notify.node_topic(node)

        def changed_elsewhere(action):  # noqa: ANN001
            since = api_platform.notifier.version(topic)
            action()
            # the other process's publish reaches this one through Redis
            assert api_platform.notifier.wait(topic, since, 30.0), "no notification through Redis"

        with other.sessions() as s:
            job = job_service.submit_job(session=s, spec=JobCreate(name="j", command=["sleep", "9"], gpus_per_node=1),
                                         user=alice)
            job_id = job.id

        def cycle() -> None:
            with other.sessions() as s:
                run_cycle(s, settings=other.settings)

        changed_elsewhere(cycle)  # the scheduler (another process) starts the job here

        def beat(digest: str | None, util: float = 50.0) -> dict:
            hb = Heartbeat(node=node, assignments_digest=digest,
                           gpus=[GpuMetrics(index=0, uuid="G0", util_pct=util)],
                           attempts=[AttemptStatus(job_id=job_id, attempt=1,
                                                   ranks=[RankStatus(rank=0, local_rank=0, pid=7)])])
            r = client.post("/api/v1/agent/heartbeat", json=hb.model_dump(mode="json"), headers=h)
            assert r.status_code == 200, r.text
            return r.json()

        def seen_at():  # noqa: ANN202
            with other.sessions() as s:
                n = s.scalar(select(Node).where(Node.name == node))
                return n.last_heartbeat_at, n.gpu_metrics

        first = beat(None)
        assert [a["action"] for a in first["assignments"]] == ["run"]
        digest = first["assignments_digest"]
        beat(digest)  # the agent holds the list now: this full pass is remembered
        cache = app.state.reply_cache
        hits = cache.hits
        before, _ = seen_at()
        again = beat(digest, util=93.0)
        assert cache.hits == hits + 1, "a steady heartbeat was not answered from the cache"
        assert again["assignments"] == first["assignments"] and again["assignments_digest"] == digest
        after, metrics = seen_at()
        assert after > before and metrics[0]["util_pct"] == 93.0  # liveness and figures still written

        # another process cancels the job: the very next heartbeat must carry the stop
        def cancel() -> None:
            with other.sessions() as s:
                job_service.cancel_job(session=s, job_id=job_id, user=alice)

        changed_elsewhere(cancel)
        hits = cache.hits
        reply = beat(digest)
        assert cache.hits == hits
        assert [a["action"] for a in reply["assignments"]] == ["stop"]
        assert reply["assignments_digest"] != digest
