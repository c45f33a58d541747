"""Issue 12, reads: the node list kept per API process (services/nodes.NodeListCache) while the
revision the database raises (migration 0016's triggers) is unchanged. Every change the list shows
but the heartbeats' figures raises it, whoever commits it; the heartbeats' figures are served up to
the maximum age old; on PostgreSQL a transaction raises it once, at commit, and a rolled-back one
not at all; two API replicas on one database never serve each other's committed changes late."""

from __future__ import annotations

import json
from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text, update
from sqlalchemy.orm import sessionmaker

from hai.db.base import utcnow
from hai.db.migrate import upgrade
from hai.db.models import JobAllocation, Node, User
from hai.main import create_app
from hai.protocol import GpuMetrics, Heartbeat
from hai.services import nodes as node_service
from hai.services.nodes import NodeListCache, node_list_revision
from tests.conftest import Api


def _rev(sessions) -> int:  # noqa: ANN001
    with sessions() as s:
        return node_list_revision(session=s)


def _seed_job(s) -> int:  # noqa: ANN001
    """A user and a job row for allocations to point at (raw SQL: no ORM defaults needed)."""
    s.add(User(id=1, name="alice", group="g"))
    s.flush()
    return s.execute(text(
        "INSERT INTO jobs (name, user_id, user_name, \"group\", command, env, tags, job_type, nodes, gpus_per_node,"
        " priority, submitted_priority, allow_cross_zone, suspend_grace_s, state, created_at, queued_at, attempt,"
        " suspensions, restarts, reserved_nodes, desired_action, user_suspended, lost_gpu_s, run_s)"
        " VALUES ('j', 1, 'alice', 'g', '[]', '{}', '[]', 'command', 1, 1, 'NORMAL', 'NORMAL', false, 60, 'running',"
        " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 1, 0, 0, '[]', 'run', false, 0, 0) RETURNING id")).scalar_one()


def test_the_revision_rises_with_what_the_list_shows_and_not_with_heartbeat_figures(sessions):
    r = _rev(sessions)
    with sessions() as s:
        s.add(Node(name="n0", zone="A", leaf="A1", gpus=8))
        s.commit()
    assert _rev(sessions) > r, "a node added"
    r = _rev(sessions)
    with sessions() as s:  # what every heartbeat writes: not a change of the list's revision
        s.execute(update(Node).where(Node.name == "n0").values(
            last_heartbeat_at=utcnow(), gpu_util_pct=55.5, gpus_busy=3, gpu_metrics=[{"index": 0, "util_pct": 55.5}]))
        s.execute(update(Node).where(Node.name == "n0").values(state="ready", zone="A"))  # the same values
        s.commit()
    assert _rev(sessions) == r
    with sessions() as s:
        s.execute(update(Node).where(Node.name == "n0").values(state="draining", state_reason="bad fan"))
        s.rollback()
    assert _rev(sessions) == r, "a rolled-back change"
    for values in ({"state": "draining"}, {"state_reason": "bad fan"}, {"leaf": "A2"}, {"gpus": 4},
                   {"address": "10.0.0.9"}, {"fake_gpus": True}):
        with sessions() as s:
            s.execute(update(Node).where(Node.name == "n0").values(**values))
            s.commit()
        assert _rev(sessions) > r, values
        r = _rev(sessions)
    with sessions() as s:
        job = _seed_job(s)
        s.add(JobAllocation(job_id=job, attempt=1, node_name="n0", node_rank=0, gpus=[0, 1]))
        s.commit()
    assert _rev(sessions) > r, "an allocation taken"
    r = _rev(sessions)
    with sessions() as s:
        s.execute(update(JobAllocation).values(gpus=[0, 1]))  # unchanged
        s.commit()
    assert _rev(sessions) == r
    with sessions() as s:
        s.execute(update(JobAllocation).values(active=False))
        s.commit()
    assert _rev(sessions) > r, "an allocation released"
    r = _rev(sessions)
    with sessions() as s:
        s.execute(text("DELETE FROM job_allocations"))
        s.execute(text("DELETE FROM nodes WHERE name = 'n0'"))
        s.commit()
    assert _rev(sessions) > r, "rows deleted"


def test_postgresql_raises_the_revision_once_per_transaction(pg_url):
    upgrade(pg_url)
    engine = create_engine(pg_url)
    sessions = sessionmaker(engine)
    r = _rev(sessions)
    with sessions() as s:  # 20 nodes, a state change and a relabel: one commit, one step
        s.add_all([Node(name=f"n{i}", gpus=8) for i in range(20)])
        s.flush()
        s.execute(update(Node).values(state="draining"))
        s.execute(update(Node).values(leaf="L2"))
        assert node_list_revision(session=s) == r, "raised at commit, not before"
        s.commit()
    assert _rev(sessions) == r + 1
    with sessions() as s:
        s.execute(update(Node).values(state="ready"))
        s.commit()
    assert _rev(sessions) == r + 2, "the flag is the transaction's own: the next one raises again"
    engine.dispose()


def test_the_kept_list_is_served_until_its_revision_changes_or_it_is_too_old(sessions):
    with sessions() as s:
        s.add_all([Node(name="n0", zone="A", leaf="A1", gpus=8, gpu_util_pct=10.0, gpus_busy=1),
                   Node(name="n1", zone="A", leaf="A1", gpus=8)])
        s.commit()
    now = [1000.0]
    cache = NodeListCache(1.0, clock=lambda: now[0])

    def get() -> dict:
        with sessions() as s:
            return {n["name"]: n for n in json.loads(cache.get(session=s))}

    def built_now() -> dict:
        with sessions() as s:
            return {n["name"]: n for n in json.loads(node_service.list_nodes_json(session=s))}

    assert get() == built_now() and get()["n0"]["gpu_util_pct"] == 10.0 and cache.builds == 1
    assert get()["n0"]["gpu_util_pct"] == 10.0 and cache.builds == 1, "a second read is served the kept document"
    with sessions() as s:  # a heartbeat's figures: served as they were until the document is 1 s old
        s.execute(update(Node).where(Node.name == "n0").values(gpu_util_pct=90.0, gpus_busy=8,
                                                               last_heartbeat_at=utcnow()))
        s.commit()
    now[0] += 1.0
    assert get()["n0"]["gpu_util_pct"] == 10.0 and cache.builds == 1
    now[0] += 0.01
    n0 = get()["n0"]
    assert (n0["gpu_util_pct"], n0["gpus_busy"], cache.builds) == (90.0, 8, 2)
    assert n0["last_heartbeat_at"] is not None
    with sessions() as s:  # a drain and an allocation: in the very next read, whatever the age
        job = _seed_job(s)
        s.execute(update(Node).where(Node.name == "n1").values(state="draining", state_reason="bad fan"))
        s.add(JobAllocation(job_id=job, attempt=1, node_name="n0", node_rank=0, gpus=[0, 1, 2]))
        s.commit()
    nodes = get()
    assert nodes == built_now()
    assert (nodes["n1"]["state"], nodes["n1"]["state_reason"]) == ("draining", "bad fan")
    assert (nodes["n0"]["free_gpus"], nodes["n0"]["running_jobs"], cache.builds) == (5, [job], 3)
    with sessions() as s:
        s.execute(update(JobAllocation).values(active=False))
        s.commit()
    assert get()["n0"]["free_gpus"] == 8 and cache.builds == 4

    uncached = NodeListCache(0.0, clock=lambda: now[0])
    for _ in range(3):
        with sessions() as s:
            uncached.get(session=s)
    assert uncached.builds == 3


def test_an_expired_list_is_rebuilt_by_one_request_while_the_others_get_the_kept_one(sessions):
    with sessions() as s:
        s.add(Node(name="n0", gpus=8, gpu_util_pct=10.0))
        s.commit()
    now = [0.0]
    cache = NodeListCache(1.0, clock=lambda: now[0])
    with sessions() as s:
        kept = cache.get(session=s)
    with sessions() as s:
        s.execute(update(Node).values(gpu_util_pct=20.0))
        s.commit()
    now[0] = 5.0
    assert cache._lock.acquire(blocking=False)  # a request of this process is rebuilding it
    try:
        with sessions() as s:
            assert cache.get(session=s) == kept and cache.builds == 1
    finally:
        cache._lock.release()
    with sessions() as s:
        assert json.loads(cache.get(session=s))[0]["gpu_util_pct"] == 20.0 and cache.builds == 2


def test_two_api_replicas_serve_each_others_changes_in_their_next_list(replicas):
    """Two API processes on one PostgreSQL, each keeping its node list for up to a minute: a node
    registered and drained through one is in the other's next list, as is the undrain."""
    a, b = replicas(2, http={"node_list_max_age_s": 60.0})
    with TestClient(create_app(a)) as ca, TestClient(create_app(b)) as cb:
        api = Api(ca, a)  # its users and tokens are in the one database: the other replica takes them too

        def listed(client: TestClient) -> list[dict]:
            r = client.get("/api/v1/nodes", headers=api.h(api.admin))
            assert r.status_code == 200, r.text
            return r.json()

        api.register_node("n0")
        nodes = listed(cb)
        assert [(n["name"], n["state"], n["free_gpus"]) for n in nodes] == [("n0", "ready", 8)]
        assert listed(cb) == nodes and b.node_list.builds == 1
        r = api.post("/api/v1/nodes/n0/drain", api.admin, json={"reason": "bad fan"})
        assert r.status_code == 200, r.text
        drained = r.json()
        assert drained["state"] == "drained" and "bad fan" in drained["state_reason"]  # no jobs to move off
        nodes = listed(cb)
        assert [(n["name"], n["state"], n["state_reason"]) for n in nodes] == [
            ("n0", drained["state"], drained["state_reason"])]
        assert b.node_list.builds == 2
        api.register_node("n1")
        assert [n["name"] for n in listed(cb)] == ["n0", "n1"]
        assert [n["name"] for n in listed(ca)] == ["n0", "n1"]
        # and the other way round
        r = cb.post("/api/v1/nodes/n0/undrain", headers=api.h(api.admin), json={"force": True})  # no agent to validate
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "ready" and listed(ca)[0]["state"] == "ready"


def test_a_heartbeat_without_news_does_not_raise_the_revision(replicas):
    """The agents' steady reports (1,250 a second at Fire-Flyer scale) keep the kept list valid."""
    (a,) = replicas(1, http={"node_list_max_age_s": 60.0})
    with TestClient(create_app(a)) as ca:
        api = Api(ca, a)
        api.register_node("n0")
        with a.sessions() as s:
            r = node_list_revision(session=s)
        hb = Heartbeat(node="n0", gpus=[GpuMetrics(index=i, uuid=f"GPU-n0-{i}", util_pct=50.0 + i) for i in range(8)])
        for _ in range(3):
            resp = ca.post("/api/v1/agent/heartbeat", json=hb.model_dump(mode="json"), headers=api.h(api.agent))
            assert resp.status_code == 200, resp.text
        with a.sessions() as s:
            assert node_list_revision(session=s) == r
            assert s.get(Node, 1).last_heartbeat_at > utcnow() - timedelta(minutes=1)
