"""Steady heartbeats are answered from the API process's reply cache (issue 12), without the
database: their liveness is written in batches (``ReplyCache.flush``; the tests set the batch
interval to an hour and flush by hand, so what is written when is theirs to say). A change made
by another process (the scheduler, another API replica) reaches that cache through Redis at
once: PostgreSQL + Redis, two platforms standing for two processes."""

from __future__ import annotations

import time
import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from hai.db.models import Node, ValidationRun
from hai.main import create_app
from hai.protocol import AgentHello, AttemptStatus, GpuInfo, GpuMetrics, Heartbeat, RankStatus
from hai.schemas.jobs import JobCreate
from hai.services import auth, node_health, notify
from hai.services import jobs as job_service
from hai.services.scheduling import run_cycle
from tests.integration.conftest import pg_url, redis_url, replicas, server_db_url  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration


@pytest.fixture
def two(replicas):  # noqa: ANN001, ANN201
    return replicas(2, validation={"quick_every_heartbeats": 0}, agent={"liveness_flush_s": 3600})


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
        assert seen_at()[0] == before, "a steady heartbeat wrote to the database"
        assert cache.pending() == 1
        assert cache.flush() == 1  # the batched write: liveness and figures
        after, metrics = seen_at()
        assert after > before and metrics[0]["util_pct"] == 93.0
        assert cache.pending() == 0

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


class _SteadyNode:
    """One registered node running one job, heartbeating through ``app`` (the API process);
    ``other`` stands for the scheduler and the other replicas."""

    def __init__(self, api_platform, other, client, agent_token: str, alice, name: str | None = None) -> None:  # noqa: ANN001
        self.api, self.other, self.client = api_platform, other, client
        self.h = {"Authorization": f"Bearer {agent_token}"}
        self.node = name or f"cache-{uuid.uuid4().hex[:8]}"
        hello = AgentHello(node=self.node, address="127.0.0.1", zone="A", leaf="A1", fake_gpus=True,
                           gpus=[GpuInfo(index=0, uuid="G0", model="Fake", memory_total_mib=1)])
        assert client.post("/api/v1/agent/register", json=hello.model_dump(mode="json"), headers=self.h).status_code == 200
        with other.sessions() as s:
            self.job_id = job_service.submit_job(
                session=s, spec=JobCreate(name="j", command=["sleep", "9"], gpus_per_node=1), user=alice).id
        self.changed_elsewhere(lambda: run_cycle_in(other))
        self.digest = None
        self.digest = self.beat()["assignments_digest"]

    def changed_elsewhere(self, action) -> None:  # noqa: ANN001
        topic = notify.node_topic(self.node)
        since = self.api.notifier.version(topic)
        action()
        assert self.api.notifier.wait(topic, since, 30.0), "no notification through Redis"

    def beat(self, *, version: int = 1, status: int = 200, validations: list | None = None) -> dict:
        hb = Heartbeat(node=self.node, assignments_digest=self.digest,
                       gpus=[GpuMetrics(index=0, uuid="G0", util_pct=50.0)],
                       attempts=[AttemptStatus(job_id=self.job_id, attempt=1,
                                               ranks=[RankStatus(rank=0, local_rank=0, pid=7)])],
                       validations=validations or [])
        body = hb.model_dump(mode="json") | {"protocol_version": version}
        r = self.client.post("/api/v1/agent/heartbeat", json=body, headers=self.h)
        assert r.status_code == status, r.text
        return r.json()

    def row(self) -> Node:
        with self.other.sessions() as s:
            return s.scalar(select(Node).where(Node.name == self.node))


def run_cycle_in(platform) -> None:  # noqa: ANN001
    with platform.sessions() as s:
        run_cycle(s, settings=platform.settings)


def _setup(api_platform, other):  # noqa: ANN001, ANN202
    with other.sessions() as s:
        agent_token = auth.create_agent_token(session=s)
        user, _ = auth.create_user(session=s, name=f"u{uuid.uuid4().hex[:6]}", group="g")
        alice = auth.Principal(kind="user", user_id=user.id, name=user.name, group="g")
    return agent_token, alice


def test_a_node_whose_state_changed_is_not_written_by_the_batch_and_is_answered_in_full(two):
    from hai.domain.nodes import NodeState
    from hai.services.node_state import set_node_state

    api_platform, other = two
    agent_token, alice = _setup(api_platform, other)
    app = create_app(api_platform)
    with TestClient(app) as client:
        n = _SteadyNode(api_platform, other, client, agent_token, alice)
        n.beat()  # a full pass that the cache keeps
        cache = app.state.reply_cache
        hits = cache.hits
        n.beat()
        assert cache.hits == hits + 1 and cache.pending() == 1
        before = n.row().last_heartbeat_at

        def lose() -> None:  # the reaper (another process) gives the node's work away
            with other.sessions() as s:
                node = s.scalar(select(Node).where(Node.name == n.node).with_for_update())
                set_node_state(s, node, NodeState.LOST, actor="platform", reason="silent (test)")
                s.commit()

        n.changed_elsewhere(lose)
        assert cache.flush() == 0, "the batch wrote liveness over the reaper's verdict"
        row = n.row()
        assert row.state == NodeState.LOST.value and row.last_heartbeat_at == before
        reply = n.beat()
        assert cache.hits == hits + 1  # not from the cache: the node must hand in its inventory again
        assert reply["reregister"] is True


def test_the_reaper_reads_batched_liveness_and_still_finds_a_node_gone_silent(two):
    from datetime import timedelta

    from hai.services.reaper import mark_lost_nodes

    api_platform, other = two
    agent_token, alice = _setup(api_platform, other)
    app = create_app(api_platform)
    lost_after = timedelta(seconds=other.settings.agent.lost_after_s)
    with TestClient(app) as client:
        n = _SteadyNode(api_platform, other, client, agent_token, alice)
        n.beat()
        cache = app.state.reply_cache
        hits = cache.hits
        for _ in range(3):
            n.beat()
        assert cache.hits == hits + 3
        cache.flush()
        last = n.row().last_heartbeat_at
        with other.sessions() as s:  # just inside the limit after the last answered heartbeat: alive
            assert n.node not in mark_lost_nodes(session=s, settings=other.settings,
                                                 now=last + lost_after - timedelta(seconds=1))
        with other.sessions() as s:  # the agent said nothing after that: lost
            assert n.node in mark_lost_nodes(session=s, settings=other.settings,
                                             now=last + lost_after + timedelta(seconds=1))
        assert n.row().state == "lost"


def test_the_quick_round_comes_on_the_same_heartbeat_as_without_the_cache(replicas):
    every = 4
    api_platform, other = replicas(2, validation={"quick_every_heartbeats": every}, agent={"liveness_flush_s": 3600})
    agent_token, alice = _setup(api_platform, other)
    app = create_app(api_platform)
    with TestClient(app) as client:
        # a node whose first round is not put off (issue 12 spreads new nodes' rounds by name)
        name = f"cache-{uuid.uuid4().hex[:8]}"
        while node_health.quick_phase(name, api_platform.settings):
            name = f"cache-{uuid.uuid4().hex[:8]}"
        n = _SteadyNode(api_platform, other, client, agent_token, alice, name)  # its first heartbeat: 1
        hits0 = app.state.reply_cache.hits
        replies = []
        for _ in range(every - 1):
            replies.append(n.beat())
            app.state.reply_cache.flush()  # what the writer does every liveness_flush_s
        # heartbeats 2 and 3: no round; heartbeat 4 (the every-th) asks for one
        assert [bool(r["validations"]) for r in replies] == [False, False, True]
        assert [v["level"] for v in replies[-1]["validations"]] == ["quick"]
        cache = app.state.reply_cache
        assert cache.hits - hits0 >= 1  # heartbeat 3 came from the cache
        # the agent reports the round (a full pass); the heartbeat after it, without the report,
        # is answered from the reply to the report: no third full pass per round
        run = replies[-1]["validations"][0]
        report = {"run_id": run["run_id"], "level": run["level"], "started_at": 1.0, "finished_at": 2.0,
                  "checks": [{"name": "gpu_inventory", "level": "quick", "critical": True, "status": "passed",
                              "value": 1, "threshold": 1, "detail": "1 GPU as registered"}]}
        hits = cache.hits
        after_report = n.beat(validations=[report])
        assert cache.hits == hits and after_report["validations"] == []
        assert n.beat()["assignments_digest"] == n.digest
        assert cache.hits == hits + 1
        with other.sessions() as s:
            assert s.get(ValidationRun, run["run_id"]).status == "passed"


def test_an_agents_own_passed_round_is_answered_from_the_cache_and_written_with_the_liveness(replicas):
    """Protocol version 2 (issue 12): the agent runs its periodic quick rounds itself; the
    heartbeat that reports one that passed is answered from the cache (no full pass: the round
    costs the server none) and the run is written by the next batch, once however often the
    report is sent (the unique index of migration 0017, ``ON CONFLICT DO NOTHING``); a failed
    round takes a full pass and acts on the node."""
    every = 4
    api_platform, other = replicas(2, validation={"quick_every_heartbeats": every}, agent={"liveness_flush_s": 3600})
    agent_token, alice = _setup(api_platform, other)
    app = create_app(api_platform)
    with TestClient(app) as client:
        n = _SteadyNode(api_platform, other, client, agent_token, alice)
        cache = app.state.reply_cache
        counted = n.row().heartbeats_since_quick
        replies = [n.beat(version=2) for _ in range(3 * every)]  # the first is a full pass (another version)
        assert {r["quick_every_heartbeats"] for r in replies} == {every}
        assert all(r["validations"] == [] for r in replies)  # the server asks for no round
        cache.flush()
        assert n.row().heartbeats_since_quick == counted  # nor counts the heartbeats
        checks = [{"name": "gpu_inventory", "level": "quick", "critical": True, "status": "passed",
                   "value": 1, "threshold": 1, "detail": "1 GPU as registered"}]
        report = {"run_id": None, "level": "quick", "started_at": 1.7e9, "finished_at": 1.7e9 + 0.4, "checks": checks}
        hits, full = cache.hits, dict(cache.full_passes)
        assert n.beat(version=2, validations=[report])["validations"] == []
        assert n.beat(version=2, validations=[report])["validations"] == []  # the reply was lost: sent again
        assert cache.hits == hits + 2 and cache.full_passes == full

        def own_runs():  # noqa: ANN202
            with other.sessions() as s:
                return [(r.trigger, r.requested_by, r.status, r.started_at.timestamp(), len(r.checks))
                        for r in s.scalars(select(ValidationRun).where(ValidationRun.node_name == n.node))]

        assert own_runs() == []  # written behind the answer
        cache.flush()
        assert own_runs() == [("periodic", "agent", "passed", 1.7e9, 1)]
        n.beat(version=2, validations=[report])  # and once more after it was written
        cache.flush()
        assert own_runs() == [("periodic", "agent", "passed", 1.7e9, 1)]
        assert cache.full_passes == full
        # a failed round: a full pass, the node out of service, its job moved
        failed = dict(report, started_at=1.7e9 + 30, checks=[dict(checks[0], status="failed", value=0)])
        n.beat(version=2, validations=[failed])
        assert cache.full_passes.get("report", 0) == full.get("report", 0) + 1
        assert n.row().state == "unhealthy"
        assert [r[:3] for r in own_runs()] == [("periodic", "agent", "passed"), ("periodic", "agent", "failed")]


def test_an_unsupported_protocol_version_is_refused_even_with_a_cached_reply(two):
    api_platform, other = two
    agent_token, alice = _setup(api_platform, other)
    app = create_app(api_platform)
    with TestClient(app) as client:
        n = _SteadyNode(api_platform, other, client, agent_token, alice)
        n.beat()
        cache = app.state.reply_cache
        hits, pending = cache.hits, cache.pending()
        body = n.beat(version=99, status=426)
        assert "version 99" in str(body)
        assert cache.hits == hits and cache.pending() == pending
        n.beat()
        assert cache.hits == hits + 1  # the supported version is still answered from the cache


def _steady_heartbeats(app):  # noqa: ANN001, ANN202
    """The app's SteadyHeartbeats middleware, from its built stack."""
    from hai.api.agent import SteadyHeartbeats

    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, SteadyHeartbeats):
        layer = getattr(layer, "app", None)
    assert layer is not None, "SteadyHeartbeats is not in the app's middleware"
    return layer


def test_a_steady_heartbeat_is_answered_before_routing_and_everything_else_reaches_the_route(two):
    api_platform, other = two
    agent_token, alice = _setup(api_platform, other)
    with other.sessions() as s:
        _, user_token = auth.create_user(session=s, name=f"v{uuid.uuid4().hex[:6]}", group="g")
    app = create_app(api_platform)
    with TestClient(app) as client:
        n = _SteadyNode(api_platform, other, client, agent_token, alice)
        full = n.beat()  # a full pass that the cache keeps
        early = _steady_heartbeats(app)
        cache = app.state.reply_cache
        answered, hits = early.answered, cache.hits
        r = client.post("/api/v1/agent/heartbeat", headers=n.h, json=Heartbeat(
            node=n.node, assignments_digest=n.digest, protocol_version=1, gpus=[GpuMetrics(index=0, uuid="G0", util_pct=61.0)],
            attempts=[AttemptStatus(job_id=n.job_id, attempt=1, ranks=[RankStatus(rank=0, local_rank=0, pid=7)])],
        ).model_dump(mode="json"))
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == full, "the early answer is not the route's reply"
        assert early.answered == answered + 1 and cache.hits == hits + 1
        assert cache.pending() == 1 and cache.flush() == 1
        assert n.row().gpu_metrics[0]["util_pct"] == 61.0  # its liveness and figures noted as the route's

        body = Heartbeat(node=n.node, assignments_digest=n.digest, protocol_version=1,
                         attempts=[AttemptStatus(job_id=n.job_id, attempt=1,
                                                 ranks=[RankStatus(rank=0, local_rank=0, pid=7)])]).model_dump(mode="json")
        answered = early.answered
        # what is not a steady heartbeat of a known agent reaches the route, which answers as ever
        assert client.post("/api/v1/agent/heartbeat", json=body).status_code == 401  # no credential
        assert client.post("/api/v1/agent/heartbeat", json=body,
                           headers={"Authorization": "Bearer hai_not-a-real-token-at-all"}).status_code == 401
        r = client.post("/api/v1/agent/heartbeat", json=body | {"protocol_version": 99}, headers=n.h)
        assert r.status_code == 426
        r = client.post("/api/v1/agent/heartbeat", json=body | {"wait_s": -1}, headers=n.h)
        assert r.status_code == 422 and "wait_s" in r.text
        r = client.post("/api/v1/agent/heartbeat", content=b"{not json", headers=n.h | {"Content-Type": "application/json"})
        assert r.status_code == 422
        hits = cache.hits
        r = client.post("/api/v1/agent/heartbeat", json=body | {"wait_s": 0.05}, headers=n.h)  # a long poll
        assert r.status_code == 200 and r.json()["assignments_digest"] == n.digest
        assert cache.hits == hits + 1  # the route's own cached branch answered it
        r = client.post("/api/v1/agent/heartbeat", json=body | {"assignments_digest": "other"}, headers=n.h)
        assert r.status_code == 200 and r.json()["assignments_digest"] == n.digest  # a full pass
        assert early.answered == answered
        for _ in range(2):  # a user's credential, looked up, then from the token cache: the route's 403
            r = client.post("/api/v1/agent/heartbeat", json=body, headers={"Authorization": f"Bearer {user_token}"})
            assert r.status_code == 403
        assert early.answered == answered


def test_a_silent_notification_path_sends_the_next_heartbeat_through_the_service(two):
    """Entries live HAI_AGENT__REPLY_CACHE_S (60 s): that is safe because a notification path that
    goes silent (here: this process's ticks no longer reach its listener) moves the epoch, and no
    entry made before is used after it."""
    api_platform, other = two
    agent_token, alice = _setup(api_platform, other)
    app = create_app(api_platform)
    with TestClient(app) as client:
        n = _SteadyNode(api_platform, other, client, agent_token, alice)
        n.beat()  # a full pass that the cache keeps
        cache = app.state.reply_cache
        hits = cache.hits
        n.beat()
        assert cache.hits == hits + 1
        notifier = api_platform.notifier
        notifier.stale_s = 0.5
        channel, epoch = notifier.CHANNEL, notifier.epoch
        notifier.CHANNEL = f"elsewhere-{uuid.uuid4().hex}"  # its ticks go where it does not listen
        try:
            deadline = time.monotonic() + 30
            while notifier.epoch == epoch and time.monotonic() < deadline:
                time.sleep(0.01)
            assert notifier.epoch != epoch, "the silent path did not move the epoch"
        finally:
            notifier.CHANNEL = channel
        passes = dict(cache.full_passes)
        assert n.beat()["assignments_digest"] == n.digest
        assert cache.hits == hits + 1, "answered from an entry made before the path went silent"
        assert cache.full_passes.get("epoch", 0) == passes.get("epoch", 0) + 1
