"""Issue 12, protocol version 2: the agent runs its periodic quick rounds itself. The reply gives it
the period (``quick_every_heartbeats``) and the server asks for no round; a round the agent
reports without a run id is kept as a run of trigger ``periodic`` requested by ``agent``, once
however often it is sent; a failed one acts on the node as a requested round does. Version 1
agents keep the server's rounds (tests/api/test_node_health_api.py)."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from hai.db.models import Node, ValidationCheck, ValidationRun
from hai.protocol import CheckResult, Heartbeat, ValidationReport
from tests.api.test_node_health_api import job, node, running, start_job

EVERY = 3


@pytest.fixture
def cluster(api):
    api.platform.settings.validation.quick_every_heartbeats = EVERY
    api.register_node("n0", zone="A", leaf="A1")
    api.register_node("n1", zone="A", leaf="A1")
    return api


def beat(api, name: str, *, attempts=(), validations=(), version: int = 2, status: int = 200) -> dict:
    hb = Heartbeat(node=name, attempts=list(attempts), validations=list(validations), protocol_version=version)
    r = api.client.post("/api/v1/agent/heartbeat", json=hb.model_dump(mode="json"), headers=api.h(api.agent))
    assert r.status_code == status, r.text
    if status == 200:
        cache = getattr(api.client.app.state, "reply_cache", None)
        if cache is not None:
            cache.flush()  # what its writer does every liveness_flush_s: answers from the cache land
    return r.json()


def own(*, fail: bool = False, xid_hardware: bool = False, started: float | None = None) -> ValidationReport:
    at = time.time() if started is None else started
    return ValidationReport(run_id=None, level="quick", started_at=at, finished_at=at + 0.5, checks=[
        CheckResult(name="gpu_inventory", level="quick", critical=True, status="passed", value=8, threshold=8,
                    unit="GPUs"),
        CheckResult(name="gpu_xid", level="quick", critical=True, status="failed" if fail else "passed",
                    value=1 if fail else 0, threshold=0, unit="hardware Xid events",
                    detail="Xid 79 (GPU has fallen off the bus) on PCI 0000:01:00" if fail else "",
                    data={"hardware": [{"xid": 79}]} if fail or xid_hardware else {}),
    ])


def runs(api, name: str) -> list[dict]:
    r = api.get(f"/api/v1/nodes/{name}/validations")
    assert r.status_code == 200, r.text
    return r.json()


def test_a_version_2_agent_is_given_the_period_and_the_server_asks_for_no_round(cluster):
    with cluster.platform.sessions() as s:
        before = s.scalar(select(Node.heartbeats_since_quick).where(Node.name == "n0"))
    replies = [beat(cluster, "n0") for _ in range(4 * EVERY)]
    assert {r["quick_every_heartbeats"] for r in replies} == {EVERY}
    assert all(r["validations"] == [] for r in replies)
    with cluster.platform.sessions() as s:
        assert s.scalar(select(Node.heartbeats_since_quick).where(Node.name == "n0")) == before  # not counted
        assert s.query(ValidationRun).count() == 0
    # a version 1 agent is not given a period (the server asks for its rounds)
    assert beat(cluster, "n1", version=1)["quick_every_heartbeats"] == 0
    # a drained node still runs its rounds; an unhealthy one does not
    assert cluster.post("/api/v1/nodes/n0/drain", cluster.admin, json={"reason": "fan"}).status_code == 200
    assert beat(cluster, "n0")["quick_every_heartbeats"] == EVERY
    assert node(cluster, "n0")["state"] == "drained"
    beat(cluster, "n0", validations=[own(fail=True)])
    assert node(cluster, "n0")["state"] == "unhealthy"
    assert beat(cluster, "n0")["quick_every_heartbeats"] == 0
    # the period follows the setting; 0 turns the rounds off
    cluster.platform.settings.validation.quick_every_heartbeats = 0
    assert beat(cluster, "n1")["quick_every_heartbeats"] == 0


def test_a_passed_own_round_is_stored_once_however_often_it_is_sent(cluster):
    report = own()
    for _ in range(3):  # the agent sends it again until a reply came (here: every reply is lost)
        assert beat(cluster, "n0", validations=[report])["validations"] == []
    (run,) = runs(cluster, "n0")
    assert (run["trigger"], run["requested_by"], run["level"], run["status"]) == ("periodic", "agent", "quick", "passed")
    assert [c["name"] for c in run["checks"]] == ["gpu_inventory", "gpu_xid"]
    assert run["summary"] == "2 passed, 0 failed (not critical), 0 skipped"
    assert abs(time.mktime(time.strptime(run["started_at"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
               - report.started_at) < 1
    assert node(cluster, "n0")["state"] == "ready"
    # the next round is another run; two rounds in one heartbeat are two runs
    later = [own(started=report.started_at + 30), own(started=report.started_at + 60)]
    beat(cluster, "n0", validations=later)
    beat(cluster, "n0", validations=later)
    assert [r["started_at"] for r in runs(cluster, "n0")][::-1] == sorted(r["started_at"] for r in runs(cluster, "n0"))
    assert len(runs(cluster, "n0")) == 3
    with cluster.platform.sessions() as s:
        assert s.query(ValidationCheck).count() == 6


def test_a_failed_own_round_makes_the_node_unhealthy_and_moves_its_job(cluster):
    job_id, where = start_job(cluster)
    failed = own(fail=True)
    beat(cluster, where, attempts=[running(job_id)], validations=[failed])
    n = node(cluster, where)
    assert n["state"] == "unhealthy" and "gpu_xid" in n["state_reason"]
    (run,) = [r for r in runs(cluster, where) if r["requested_by"] == "agent"]
    assert (run["trigger"], run["level"], run["status"]) == ("periodic", "quick", "failed")
    assert n["events"][-1]["detail"]["run_id"] == run["id"] and n["events"][-1]["actor"] == "validator"
    assert job(cluster, job_id)["state"] == "suspending"  # moved off at its checkpoint
    # the hardware Xid asked for the full suite too, as a requested quick round's does
    assert [(r["trigger"], r["level"]) for r in runs(cluster, where)] == [("xid", "full"), ("periodic", "quick")]
    # sent again (a lost reply): nothing more is stored or done
    for _ in range(2):
        beat(cluster, where, attempts=[running(job_id)], validations=[failed])
    assert len(runs(cluster, where)) == 2 and len(node(cluster, where)["events"]) == len(n["events"])


def test_a_hardware_xid_in_a_passed_own_round_asks_for_the_full_suite(cluster):
    reply = beat(cluster, "n0", validations=[own(xid_hardware=True)])
    (req,) = reply["validations"]
    assert req["level"] == "full"
    full, quick = runs(cluster, "n0")
    assert (full["trigger"], full["status"], full["id"]) == ("xid", "pending", req["run_id"])
    assert (quick["trigger"], quick["requested_by"], quick["status"]) == ("periodic", "agent", "passed")
    assert node(cluster, "n0")["state"] == "ready"


def test_a_report_without_a_run_id_must_be_a_quick_round(cluster):
    body = Heartbeat(node="n0", protocol_version=2, validations=[own()]).model_dump(mode="json")
    body["validations"][0]["level"] = "full"
    r = cluster.client.post("/api/v1/agent/heartbeat", json=body, headers=cluster.h(cluster.agent))
    assert r.status_code == 422 and "level quick" in r.text
    assert runs(cluster, "n0") == []
