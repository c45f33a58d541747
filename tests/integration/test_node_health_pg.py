"""Node health on PostgreSQL with Redis (issue 10): drain and a gated undrain through the same
services, and the scheduled full round run by a real Celery worker."""

from __future__ import annotations

from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy import select

from hai.db.base import utcnow
from hai.db.models import Node, ValidationRun
from hai.main import create_app
from tests.api.test_node_health_api import (
    _undrain_in_background,
    _wait_for_request,
    heartbeat,
    node,
    report,
    running,
)
from tests.conftest import Api
from tests.integration.test_postgres_redis import celery_worker, pg_platform  # noqa: F401  (fixtures)



def test_drain_and_gated_undrain_on_postgresql(pg_platform):  # noqa: F811
    pg_platform.settings.validation.quick_every_heartbeats = 0
    pg_platform.settings.validation.undrain_timeout_s = 30
    with TestClient(create_app(pg_platform)) as client:
        api = Api(client, pg_platform)
        api.register_node("p0")
        api.register_node("p1")
        from tests.api.test_agent_protocol_api import cycle

        j = api.submit(gpus_per_node=8)
        assert cycle(api).started == [j["id"]]
        where = api.get(f"/api/v1/jobs/{j['id']}").json()["placement"][0]["node"]
        heartbeat(api, where, [running(j["id"])])
        assert api.post(f"/api/v1/nodes/{where}/drain", api.admin, json={"reason": "pg"}).json()["state"] == "draining"
        from hai.protocol import AttemptStatus, RankStatus

        heartbeat(api, where, [AttemptStatus(job_id=j["id"], attempt=1, suspend_ready=True, finished=True,
                                             ranks=[RankStatus(rank=0, local_rank=0, state="exited", exit_code=0)])])
        assert node(api, where)["state"] == "drained"
        body = api.get(f"/api/v1/jobs/{j['id']}").json()
        assert body["state"] == "queued" and body["suspensions"] == 0
        t, out = _undrain_in_background(api, where)
        req = _wait_for_request(api, where)
        heartbeat(api, where, validations=[report(req["run_id"])])
        t.join(60)
        assert out["status"] == 200 and out["body"]["state"] == "ready"
        assert [e["to_state"] for e in node(api, where)["events"]] == ["ready", "draining", "drained", "ready"]


def test_celery_beat_task_runs_the_full_round(pg_platform, celery_worker):  # noqa: F811
    from hai.domain.nodes import NodeState
    from hai.services.node_state import create_node, set_node_state

    with pg_platform.sessions() as s:
        for name in ("fresh", "drained", "sick", "silent"):
            create_node(s, name=name, state=NodeState.READY, actor="test", reason="test", gpus=8,
                        last_heartbeat_at=utcnow() - (timedelta(hours=1) if name == "silent" else timedelta(0)))
        nodes = {n.name: n for n in s.scalars(select(Node))}
        set_node_state(s, nodes["drained"], NodeState.DRAINED, actor="test", reason="x")
        set_node_state(s, nodes["sick"], NodeState.UNHEALTHY, actor="test", reason="x")
        s.commit()
    from hai.tasks import app, validate_nodes

    assert app.conf.beat_schedule["validate-nodes"]["schedule"] == 7 * 24 * 3600
    ids = validate_nodes.apply_async(queue=celery_worker).get(timeout=120)
    with pg_platform.sessions() as s:
        runs = list(s.scalars(select(ValidationRun).order_by(ValidationRun.id)))
    assert [r.id for r in runs] == ids
    assert sorted((r.node_name, r.level, r.trigger, r.status) for r in runs) == [
        ("drained", "full", "schedule", "pending"), ("fresh", "full", "schedule", "pending")]
    # a second round while those are pending asks for nothing more
    assert validate_nodes.apply_async(queue=celery_worker).get(timeout=120) == []
