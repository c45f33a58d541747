"""Node health over HTTP (issue 10): drain, undrain, validate, validator results and what they do
to a node and its jobs, the lost-node return gate. The agent side is driven with protocol
messages, as a real agent would send them."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from hai.db.base import utcnow
from hai.db.models import Node, NodeEvent, ValidationRun
from hai.protocol import AttemptStatus, CheckResult, Heartbeat, RankStatus, ValidationReport
from hai.services import node_health
from hai.services.reaper import mark_lost_nodes
from hai.services.scheduling import run_cycle


@pytest.fixture
def cluster(api):
    api.platform.settings.validation.quick_every_heartbeats = 0  # rounds only when a test asks
    api.platform.settings.validation.undrain_timeout_s = 20
    api.register_node("n0", zone="A", leaf="A1")
    api.register_node("n1", zone="A", leaf="A1")
    return api


def cycle(api):
    with api.platform.sessions() as s:
        return run_cycle(s, settings=api.platform.settings)


def heartbeat(api, node: str, attempts=(), validations=(), digest: str | None = None, version: int = 1) -> dict:
    """A heartbeat of protocol ``version`` (1 by default: the server asks for the periodic rounds;
    tests/api/test_own_quick_rounds.py has version 2's)."""
    hb = Heartbeat(node=node, attempts=list(attempts), validations=list(validations), assignments_digest=digest,
                   protocol_version=version)
    r = api.client.post("/api/v1/agent/heartbeat", json=hb.model_dump(mode="json"), headers=api.h(api.agent))
    assert r.status_code == 200, r.text
    return r.json()


def running(job_id: int, attempt: int = 1) -> AttemptStatus:
    return AttemptStatus(job_id=job_id, attempt=attempt, ranks=[RankStatus(rank=0, local_rank=0, pid=4242)])


def report(run_id: int, *, fail: str | None = None, level: str = "full", xid_hardware: bool = False) -> ValidationReport:
    now = time.time()
    checks = [
        CheckResult(name="gpu_inventory", level="quick", critical=True, status="passed", value=8, threshold=8,
                    unit="GPUs"),
        CheckResult(name="gpu_xid", level="quick", critical=True, status="failed" if fail == "gpu_xid" else "passed",
                    value=1 if fail == "gpu_xid" else 0, threshold=0, unit="hardware Xid events",
                    detail="Xid 79 (GPU has fallen off the bus) on PCI 0000:01:00" if fail == "gpu_xid" else "",
                    data={"hardware": [{"xid": 79}]} if xid_hardware or fail == "gpu_xid" else {}),
        CheckResult(name="host_mem_bw", level="full", critical=False, status="failed", value=1.5, threshold=2.0,
                    unit="GB/s"),
        CheckResult(name="gemm_tflops", level="full", critical=True, status="skipped",
                    detail="torch has no CUDA device here"),
    ]
    return ValidationReport(run_id=run_id, level=level, started_at=now - 1, finished_at=now, checks=checks)


def node(api, name: str) -> dict:
    r = api.get(f"/api/v1/nodes/{name}")
    assert r.status_code == 200, r.text
    return r.json()


def job(api, job_id: int) -> dict:
    return api.get(f"/api/v1/jobs/{job_id}").json()


def start_job(api, **body) -> tuple[int, str]:
    j = api.submit(gpus_per_node=8, **body)
    assert cycle(api).started == [j["id"]]
    where = job(api, j["id"])["placement"][0]["node"]
    heartbeat(api, where, [running(j["id"])])
    assert job(api, j["id"])["state"] == "running"
    return j["id"], where


def _counts(api) -> tuple:
    with api.platform.sessions() as s:
        return (
            tuple((n.name, n.state, n.state_reason) for n in s.query(Node).order_by(Node.name)),
            s.query(NodeEvent).count(),
            s.query(ValidationRun).count(),
        )


# -- who may do what -------------------------------------------------------------------------
ADMIN_ACTIONS = [
    ("/api/v1/nodes/n0/drain", {"reason": "bad fan"}),
    ("/api/v1/nodes/n0/undrain", {"force": True}),
    ("/api/v1/nodes/n0/undrain", {"force": False}),
    ("/api/v1/nodes/n0/validate", None),
]


@pytest.mark.parametrize(("path", "body"), ADMIN_ACTIONS)
def test_only_admins_act_on_nodes_and_refusals_change_nothing(cluster, path, body):
    # drain first so that undrain would have something to do
    assert cluster.post("/api/v1/nodes/n1/drain", cluster.admin, json={"reason": "setup"}).status_code == 200
    before = _counts(cluster)
    assert cluster.client.post(path, json=body).status_code == 401
    assert cluster.post(path, cluster.alice, json=body).status_code == 403
    assert cluster.post(path, cluster.agent, json=body).status_code == 403
    assert cluster.post(path.replace("/n0/", "/nope/"), cluster.admin, json=body).status_code == 404
    assert _counts(cluster) == before


def test_a_drain_needs_a_reason(cluster):
    before = _counts(cluster)
    for body in ({}, {"reason": ""}, {"reason": "   "}):
        r = cluster.post("/api/v1/nodes/n0/drain", cluster.admin, json=body)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body", "reason"]
    assert _counts(cluster) == before


def test_reads_are_for_every_user(cluster):
    assert cluster.get("/api/v1/nodes/n0").status_code == 200
    assert cluster.get("/api/v1/nodes/n0/validations").json() == []
    assert cluster.get("/api/v1/nodes/zz").status_code == 404
    assert cluster.get("/api/v1/validations/999").status_code == 404
    assert cluster.client.get("/api/v1/nodes/n0").status_code == 401


# -- drain -----------------------------------------------------------------------------------
def test_draining_an_idle_node_drains_it_at_once_with_the_reason(cluster):
    r = cluster.post("/api/v1/nodes/n0/drain", cluster.admin, json={"reason": "replacing a DIMM"})
    body = r.json()
    assert r.status_code == 200 and body["state"] == "drained"
    assert body["state_reason"] == "drained by root: replacing a DIMM"
    ev = body["events"][-1]
    assert (ev["from_state"], ev["to_state"], ev["actor"]) == ("ready", "drained", "admin:root")
    assert [e["to_state"] for e in body["events"]] == ["ready", "drained"]  # registered, drained
    # nothing is placed there; a second drain is refused
    assert cluster.post("/api/v1/nodes/n0/drain", cluster.admin, json={"reason": "again"}).status_code == 409
    cluster.submit(gpus_per_node=8, name="a")
    cluster.submit(gpus_per_node=8, name="b")
    started = cycle(cluster).started
    assert len(started) == 1 and job(cluster, started[0])["placement"][0]["node"] == "n1"


def test_drain_moves_the_job_at_its_checkpoint_keeping_its_place(cluster):
    job_id, where = start_job(cluster)
    other = "n1" if where == "n0" else "n0"
    before = job(cluster, job_id)
    r = cluster.post(f"/api/v1/nodes/{where}/drain", cluster.admin, json={"reason": "flaky NIC"})
    assert r.json()["state"] == "draining"
    body = job(cluster, job_id)
    assert body["state"] == "suspending" and f"moving off node {where}" in body["events"][-1]["reason"]
    (a,) = heartbeat(cluster, where, [running(job_id)])["assignments"]
    assert a["action"] == "suspend"
    # the job checkpoints and exits: requeued, not a suspension, not a failure
    done = AttemptStatus(job_id=job_id, attempt=1, suspend_ready=True, finished=True, stop_cause="suspend",
                         ranks=[RankStatus(rank=0, local_rank=0, state="exited", exit_code=0)],
                         checkpoint={"path": "/ckpt/7", "step": 7, "at": time.time()})
    heartbeat(cluster, where, [done])
    body = job(cluster, job_id)
    assert body["state"] == "queued"
    assert body["suspensions"] == 0 and body["restarts"] == 0 and body["exit_code"] is None
    assert body["failure_reason"] is None and body["created_at"] == before["created_at"]
    assert body["events"][-1]["reason"] == f"moved off node {where} (drain) at its checkpoint (step 7)"
    assert node(cluster, where)["state"] == "drained"
    assert node(cluster, where)["state_reason"] == "drained by root: flaky NIC"
    # it resumes elsewhere, from its checkpoint
    assert cycle(cluster).started == [job_id]
    body = job(cluster, job_id)
    assert body["placement"][0]["node"] == other and body["attempt"] == 2
    (a,) = heartbeat(cluster, other)["assignments"]
    assert a["spec"]["resume_from"] == "/ckpt/7"


# -- undrain ---------------------------------------------------------------------------------
def test_force_undrain_skips_the_gate_and_says_so(cluster):
    cluster.post("/api/v1/nodes/n0/drain", cluster.admin, json={"reason": "x"})
    r = cluster.post("/api/v1/nodes/n0/undrain", cluster.admin, json={"force": True})
    assert r.status_code == 200 and r.json()["state"] == "ready"
    assert "forced" in r.json()["events"][-1]["reason"] and r.json()["events"][-1]["detail"] == {"forced": True}
    assert cluster.get("/api/v1/nodes/n0/validations").json() == []
    # a ready node cannot be undrained
    assert cluster.post("/api/v1/nodes/n0/undrain", cluster.admin, json={"force": True}).status_code == 409


def _undrain_in_background(api, name: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def go():
        r = api.post(f"/api/v1/nodes/{name}/undrain", api.admin, json={"force": False})
        out["status"], out["body"] = r.status_code, r.json()

    t = threading.Thread(target=go)
    t.start()
    return t, out


def _wait_for_request(api, name: str) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        reply = heartbeat(api, name)
        if reply["validations"]:
            return reply["validations"][0]
        time.sleep(0.05)
    raise AssertionError("no validation request reached the agent")


def test_undrain_runs_the_full_suite_and_refuses_naming_the_failed_check(cluster):
    cluster.post("/api/v1/nodes/n0/drain", cluster.admin, json={"reason": "x"})
    t, out = _undrain_in_background(cluster, "n0")
    req = _wait_for_request(cluster, "n0")
    assert req["level"] == "full" and len(req["expected_gpus"]) == 8
    heartbeat(cluster, "n0", validations=[report(req["run_id"], fail="gpu_xid")])
    t.join(30)
    assert out["status"] == 409
    detail = out["body"]["detail"]
    assert "n0" in detail["message"]
    assert detail["failed_checks"] == [{"name": "gpu_xid", "value": 1.0, "threshold": 0.0,
                                        "unit": "hardware Xid events",
                                        "detail": "Xid 79 (GPU has fallen off the bus) on PCI 0000:01:00"}]
    # a failed critical check makes the node unhealthy, with the check in the reason
    n = node(cluster, "n0")
    assert n["state"] == "unhealthy" and "gpu_xid" in n["state_reason"]
    assert n["latest_validation"]["id"] == req["run_id"] and n["latest_validation"]["status"] == "failed"
    # the run is kept with every check
    (run,) = cluster.get("/api/v1/nodes/n0/validations").json()
    assert run["trigger"] == "undrain" and [c["name"] for c in run["checks"]] == [
        "gpu_inventory", "gpu_xid", "host_mem_bw", "gemm_tflops"]
    assert run["checks"][3]["status"] == "skipped" and run["checks"][3]["detail"]
    # a report sent twice is absorbed once
    heartbeat(cluster, "n0", validations=[report(req["run_id"])])
    assert cluster.get(f"/api/v1/validations/{req['run_id']}").json()["status"] == "failed"
    # force brings it back
    assert cluster.post("/api/v1/nodes/n0/undrain", cluster.admin, json={"force": True}).json()["state"] == "ready"


def test_undrain_of_a_healthy_node_succeeds_after_a_passing_run(cluster):
    cluster.post("/api/v1/nodes/n0/drain", cluster.admin, json={"reason": "x"})
    t, out = _undrain_in_background(cluster, "n0")
    req = _wait_for_request(cluster, "n0")
    heartbeat(cluster, "n0", validations=[report(req["run_id"])])  # a non-critical failure only
    t.join(30)
    assert out["status"] == 200, out
    assert out["body"]["state"] == "ready"
    assert out["body"]["events"][-1]["reason"] == f"undrained by root: validation run {req['run_id']} passed"
    # the agent is no longer asked for it
    assert heartbeat(cluster, "n0")["validations"] == []


def test_undrain_of_a_silent_node_is_refused(cluster):
    cluster.post("/api/v1/nodes/n0/drain", cluster.admin, json={"reason": "x"})
    with cluster.platform.sessions() as s:
        n = s.query(Node).filter_by(name="n0").one()
        n.last_heartbeat_at = utcnow() - timedelta(hours=1)
        s.commit()
    r = cluster.post("/api/v1/nodes/n0/undrain", cluster.admin, json={})
    assert r.status_code == 409 and "not connected" in r.json()["detail"]


# -- validate and automatic unhealthy ------------------------------------------------------
def test_validate_answers_202_with_the_run_and_the_agent_receives_it(cluster):
    r = cluster.post("/api/v1/nodes/n1/validate", cluster.admin)
    assert r.status_code == 202
    run = r.json()
    assert run["status"] == "pending" and run["node"] == "n1" and run["level"] == "full"
    (req,) = heartbeat(cluster, "n1")["validations"]
    assert req["run_id"] == run["id"]
    # replayed until answered
    assert heartbeat(cluster, "n1")["validations"][0]["run_id"] == run["id"]
    heartbeat(cluster, "n1", validations=[report(run["id"])])
    got = cluster.get(f"/api/v1/validations/{run['id']}").json()
    assert got["status"] == "passed" and len(got["checks"]) == 4
    r2 = cluster.post("/api/v1/nodes/n1/validate", cluster.admin, json={"level": "quick"}).json()
    listed = cluster.get("/api/v1/nodes/n1/validations").json()
    assert [x["id"] for x in listed] == [r2["id"], run["id"]]  # newest first
    assert node(cluster, "n1")["state"] == "ready"


def test_quick_rounds_every_n_heartbeats(cluster):
    cluster.platform.settings.validation.quick_every_heartbeats = 3
    replies = [heartbeat(cluster, "n0") for _ in range(3)]
    assert [len(r["validations"]) for r in replies] == [0, 0, 1]
    assert replies[2]["validations"][0]["level"] == "quick"
    # no second round while one is pending
    assert len(heartbeat(cluster, "n0")["validations"]) == 1
    (run,) = cluster.get("/api/v1/nodes/n0/validations").json()
    assert run["trigger"] == "periodic"
    # the heartbeat that delivers the result does not count towards the next round
    assert heartbeat(cluster, "n0", validations=[report(run["id"], level="quick")])["validations"] == []
    replies = [heartbeat(cluster, "n0") for _ in range(3)]
    assert [len(r["validations"]) for r in replies] == [0, 0, 1]


def test_a_critical_failure_makes_the_node_unhealthy_and_moves_its_job(cluster):
    job_id, where = start_job(cluster)
    run = cluster.post(f"/api/v1/nodes/{where}/validate", cluster.admin, json={"level": "quick"}).json()
    heartbeat(cluster, where, [running(job_id)], validations=[report(run["id"], fail="gpu_xid", level="quick")])
    n = node(cluster, where)
    assert n["state"] == "unhealthy"
    assert "gpu_xid" in n["state_reason"] and "Xid 79" in n["state_reason"]
    assert n["state_detail"]["failed_checks"][0]["name"] == "gpu_xid"
    assert n["events"][-1]["actor"] == "validator"
    assert job(cluster, job_id)["state"] == "suspending"
    # a hardware Xid in a quick round asks for the full suite
    full = cluster.get(f"/api/v1/nodes/{where}/validations").json()[0]
    assert (full["level"], full["trigger"], full["status"]) == ("full", "xid", "pending")
    # the fault kills the rank before it can checkpoint: a restart, not the job's failure
    dead = AttemptStatus(job_id=job_id, attempt=1, finished=True,
                         ranks=[RankStatus(rank=0, local_rank=0, state="exited", exit_code=-9)])
    heartbeat(cluster, where, [dead])
    body = job(cluster, job_id)
    assert body["state"] == "queued" and body["restarts"] == 1 and body["suspensions"] == 0
    assert body["failure_reason"] is None and "faulty" in body["events"][-1]["reason"]
    assert node(cluster, where)["state"] == "unhealthy"  # not drained: it waits for an undrain


def test_a_job_that_failed_shortly_before_its_node_was_found_faulty_is_requeued(cluster):
    job_id, where = start_job(cluster)
    heartbeat(cluster, where, [AttemptStatus(job_id=job_id, attempt=1, finished=True,
                                             ranks=[RankStatus(rank=0, local_rank=0, state="exited", exit_code=1)])])
    assert job(cluster, job_id)["state"] == "failed"
    run = cluster.post(f"/api/v1/nodes/{where}/validate", cluster.admin).json()
    heartbeat(cluster, where, validations=[report(run["id"], fail="gpu_xid")])
    body = job(cluster, job_id)
    assert body["state"] == "queued" and body["restarts"] == 1
    assert body["exit_code"] is None and body["failure_reason"] is None and body["finished_at"] is None


def test_a_rank_that_dies_gets_its_node_checked_and_a_hardware_xid_requeues_the_job(cluster):
    job_id, where = start_job(cluster)
    heartbeat(cluster, where, [AttemptStatus(job_id=job_id, attempt=1, finished=True,
                                             ranks=[RankStatus(rank=0, local_rank=0, state="exited", exit_code=-7)])])
    assert job(cluster, job_id)["state"] == "failed"
    (req,) = heartbeat(cluster, where)["validations"]
    run = cluster.get(f"/api/v1/validations/{req['run_id']}").json()
    assert (run["level"], run["trigger"]) == ("quick", "rank_died")
    heartbeat(cluster, where, validations=[report(req["run_id"], fail="gpu_xid", level="quick")])
    assert node(cluster, where)["state"] == "unhealthy"
    body = job(cluster, job_id)
    assert body["state"] == "queued" and body["restarts"] == 1 and body["failure_reason"] is None
    full = cluster.get(f"/api/v1/nodes/{where}/validations").json()[0]
    assert (full["level"], full["trigger"]) == ("full", "xid")


def test_a_failure_outside_the_fault_window_stays_the_jobs(cluster):
    cluster.platform.settings.validation.fault_window_s = 0
    job_id, where = start_job(cluster)
    heartbeat(cluster, where, [AttemptStatus(job_id=job_id, attempt=1, finished=True,
                                             ranks=[RankStatus(rank=0, local_rank=0, state="exited", exit_code=1)])])
    run = cluster.post(f"/api/v1/nodes/{where}/validate", cluster.admin).json()
    heartbeat(cluster, where, validations=[report(run["id"], fail="gpu_xid")])
    assert node(cluster, where)["state"] == "unhealthy"
    body = job(cluster, job_id)
    assert body["state"] == "failed" and body["restarts"] == 0


# -- lost nodes ------------------------------------------------------------------------------
def test_a_lost_node_requeues_its_job_and_returns_only_after_a_passing_validation(cluster):
    job_id, where = start_job(cluster)
    later = utcnow() + timedelta(seconds=cluster.platform.settings.agent.lost_after_s + 5)
    with cluster.platform.sessions() as s:
        assert where in mark_lost_nodes(session=s, settings=cluster.platform.settings, now=later)
    n = node(cluster, where)
    assert n["state"] == "lost" and n["events"][-1]["actor"] == "reaper"
    body = job(cluster, job_id)
    assert body["state"] == "queued" and body["restarts"] == 1 and body["failure_reason"] is None
    assert heartbeat(cluster, where)["reregister"] is True
    # the agent comes back: still lost until its validation passes
    cluster.register_node(where)
    n = node(cluster, where)
    assert n["state"] == "lost" and "must pass" in n["state_reason"]
    reply = heartbeat(cluster, where)
    assert reply["reregister"] is False
    (req,) = reply["validations"]
    run = cluster.get(f"/api/v1/validations/{req['run_id']}").json()
    assert run["trigger"] == "return"
    heartbeat(cluster, where, validations=[report(req["run_id"])])
    n = node(cluster, where)
    assert n["state"] == "ready" and n["events"][-1]["from_state"] == "lost"


def test_a_returning_node_that_fails_its_validation_becomes_unhealthy(cluster):
    later = utcnow() + timedelta(seconds=cluster.platform.settings.agent.lost_after_s + 5)
    with cluster.platform.sessions() as s:
        mark_lost_nodes(session=s, settings=cluster.platform.settings, now=later)
    cluster.register_node("n0")
    (req,) = heartbeat(cluster, "n0")["validations"]
    heartbeat(cluster, "n0", validations=[report(req["run_id"], fail="gpu_xid")])
    assert node(cluster, "n0")["state"] == "unhealthy"


def test_a_drained_node_that_was_lost_returns_drained(cluster):
    cluster.post("/api/v1/nodes/n0/drain", cluster.admin, json={"reason": "bad DIMM"})
    later = utcnow() + timedelta(seconds=cluster.platform.settings.agent.lost_after_s + 5)
    with cluster.platform.sessions() as s:
        mark_lost_nodes(session=s, settings=cluster.platform.settings, now=later)
    assert node(cluster, "n0")["state"] == "lost"
    cluster.register_node("n0")
    (req,) = heartbeat(cluster, "n0")["validations"]
    heartbeat(cluster, "n0", validations=[report(req["run_id"])])
    n = node(cluster, "n0")
    assert n["state"] == "drained" and n["state_reason"] == "drained by root: bad DIMM"
    assert [e["to_state"] for e in n["events"]] == ["ready", "drained", "lost", "drained"]


def test_nodes_registered_together_start_their_quick_rounds_out_of_step(cluster):
    """Issue 12: a new node's first round comes 0 to every - 1 heartbeats after the every-th,
    by its name; nodes registered in one go spread their rounds over the interval."""
    every = cluster.platform.settings.validation.quick_every_heartbeats = 5
    names = [f"spread-{i}" for i in range(40)]
    for name in names:
        cluster.register_node(name)
    first = {}
    for name in names:
        for k in range(1, 2 * every + 1):
            if heartbeat(cluster, name)["validations"]:
                first[name] = k
                break
    assert set(first) == set(names)  # every node got its round within 2 * every heartbeats
    assert all(every <= k < 2 * every for k in first.values()), first
    assert len(set(first.values())) == every, first  # not all in the same heartbeat: every phase used
    assert {n: every + node_health.quick_phase(n, cluster.platform.settings) for n in names} == first
