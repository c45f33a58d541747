"""The server side of the agent protocol, driven over HTTP like a real agent would."""

from __future__ import annotations

import pytest

from hai.protocol import AttemptStatus, Heartbeat, LogBatch, LogLine, RankStatus
from hai.services.scheduling import run_cycle


@pytest.fixture
def cluster(api):
    api.register_node("n0", zone="A", leaf="A1")
    api.register_node("n1", zone="A", leaf="A2")
    return api


def cycle(api):
    with api.platform.sessions() as s:
        return run_cycle(s, settings=api.platform.settings)


def heartbeat(api, node: str, attempts: list[AttemptStatus] = (), digest: str | None = None) -> dict:
    hb = Heartbeat(node=node, attempts=list(attempts), assignments_digest=digest)
    r = api.client.post("/api/v1/agent/heartbeat", json=hb.model_dump(mode="json"), headers=api.h(api.agent))
    assert r.status_code == 200, r.text
    return r.json()


def running(job_id: int, attempt: int, ranks: list[int], local: bool = False) -> AttemptStatus:
    return AttemptStatus(
        job_id=job_id, attempt=attempt,
        ranks=[RankStatus(rank=r, local_rank=i if local else 0, pid=1000 + r) for i, r in enumerate(ranks)],
    )


def exited(job_id: int, attempt: int, codes: dict[int, int], **kw) -> AttemptStatus:
    return AttemptStatus(
        job_id=job_id, attempt=attempt,
        ranks=[RankStatus(rank=r, local_rank=0, state="exited", exit_code=c) for r, c in codes.items()], **kw,
    )


def job(api, job_id: int) -> dict:
    return api.get(f"/api/v1/jobs/{job_id}").json()


def test_two_node_job_runs_and_succeeds(cluster):
    j = cluster.submit(name="two", nodes=2, command=["echo", "hi"])
    assert cycle(cluster).started == [j["id"]]
    body = job(cluster, j["id"])
    assert body["state"] == "starting" and body["attempt"] == 1
    assert [(p["node"], p["gpus"]) for p in body["placement"]] == [("n0", list(range(8))), ("n1", list(range(8)))]
    # each node receives a `run` assignment with its node rank
    reply0 = heartbeat(cluster, "n0")
    reply1 = heartbeat(cluster, "n1")
    (a0,), (a1,) = reply0["assignments"], reply1["assignments"]
    assert (a0["action"], a0["spec"]["node_rank"], a0["spec"]["nnodes"]) == ("run", 0, 2)
    assert (a1["action"], a1["spec"]["node_rank"]) == ("run", 1)
    assert a0["spec"]["master_addr"] == a1["spec"]["master_addr"] and a0["spec"]["master_port"] == a1["spec"]["master_port"]
    # ranks start -> running
    heartbeat(cluster, "n0", [running(j["id"], 1, [0])])
    assert job(cluster, j["id"])["state"] == "starting"
    heartbeat(cluster, "n1", [running(j["id"], 1, [1])])
    assert job(cluster, j["id"])["state"] == "running"
    # both exit 0 -> succeeded, GPUs released
    heartbeat(cluster, "n0", [exited(j["id"], 1, {0: 0})])
    assert job(cluster, j["id"])["state"] == "running"
    heartbeat(cluster, "n1", [exited(j["id"], 1, {1: 0})])
    body = job(cluster, j["id"])
    assert body["state"] == "succeeded" and body["exit_code"] == 0 and body["finished_at"]
    assert [e["to_state"] for e in body["events"]] == ["queued", "starting", "running", "succeeded"]
    assert all(n["free_gpus"] == 8 for n in cluster.get("/api/v1/nodes").json())
    # the finished attempt is no longer assigned: the agent forgets it
    assert heartbeat(cluster, "n0")["assignments"] == []


def test_a_failing_rank_fails_the_job_and_stops_the_others(cluster):
    j = cluster.submit(nodes=2)
    cycle(cluster)
    heartbeat(cluster, "n0", [running(j["id"], 1, [0])])
    heartbeat(cluster, "n1", [running(j["id"], 1, [1])])
    heartbeat(cluster, "n1", [exited(j["id"], 1, {1: 3})])
    body = job(cluster, j["id"])
    assert body["state"] == "failed" and body["exit_code"] == 3
    assert body["failure_reason"] == "rank 1 on node n1 exited with code 3"
    # rank 0's node is told to stop; its GPUs stay held until the agent confirms
    (a0,) = heartbeat(cluster, "n0", [running(j["id"], 1, [0])])["assignments"]
    assert a0["action"] == "stop"
    nodes = {n["name"]: n["free_gpus"] for n in cluster.get("/api/v1/nodes").json()}
    assert nodes == {"n0": 0, "n1": 8}
    heartbeat(cluster, "n0", [exited(j["id"], 1, {0: -15})])
    assert job(cluster, j["id"])["state"] == "failed"
    assert {n["name"]: n["free_gpus"] for n in cluster.get("/api/v1/nodes").json()} == {"n0": 8, "n1": 8}


def test_cancel_running_job_stops_ranks_and_holds_gpus_until_confirmed(cluster):
    j = cluster.submit(gpus_per_node=4)
    cycle(cluster)
    heartbeat(cluster, "n0", [running(j["id"], 1, [0])])
    assert cluster.post(f"/api/v1/jobs/{j['id']}/cancel").json()["state"] == "cancelled"
    reply = heartbeat(cluster, "n0", [running(j["id"], 1, [0])])
    assert [a["action"] for a in reply["assignments"]] == ["stop"]
    assert cluster.get("/api/v1/nodes").json()[0]["free_gpus"] == 4
    # the agent applied the stop (same digest) and no longer holds the attempt: released
    heartbeat(cluster, "n0", [exited(j["id"], 1, {0: -15})], digest=reply["assignments_digest"])
    assert cluster.get("/api/v1/nodes").json()[0]["free_gpus"] == 8


def test_launch_error_fails_the_job(cluster):
    j = cluster.submit(gpus_per_node=1, command=["/nonexistent"])
    cycle(cluster)
    node = job(cluster, j["id"])["placement"][0]["node"]
    heartbeat(cluster, node, [AttemptStatus(job_id=j["id"], attempt=1, launch_error="No such file: /nonexistent")])
    body = job(cluster, j["id"])
    assert body["state"] == "failed"
    assert "No such file" in body["failure_reason"]


def test_suspend_at_checkpoint_requeues_and_resumes_from_it(cluster):
    j = cluster.submit(gpus_per_node=8, job_type="torch")
    cycle(cluster)
    node = job(cluster, j["id"])["placement"][0]["node"]
    ranks = list(range(8))
    heartbeat(cluster, node, [running(j["id"], 1, ranks, local=True)])
    assert job(cluster, j["id"])["state"] == "running"
    r = cluster.post(f"/api/v1/jobs/{j['id']}/suspend")
    assert r.json()["state"] == "suspending"
    (a,) = heartbeat(cluster, node, [running(j["id"], 1, ranks, local=True)])["assignments"]
    assert a["action"] == "suspend"
    st = AttemptStatus(
        job_id=j["id"], attempt=1, suspend_ready=True,
        ranks=[RankStatus(rank=r, local_rank=r, state="exited", exit_code=0) for r in ranks],
        checkpoint={"path": "/ckpt/step-40", "step": 40, "at": 1.7e9, "duration_s": 2.5},
    )
    heartbeat(cluster, node, [st])
    body = job(cluster, j["id"])
    assert body["state"] == "queued" and body["suspensions"] == 1 and body["held"] is True
    assert body["last_checkpoint"]["path"] == "/ckpt/step-40"
    assert body["events"][-1]["reason"] == "suspended at its checkpoint (step 40)"
    assert body["lost_gpu_s"] == 0
    # held: the scheduler leaves it alone until resumed
    assert cycle(cluster).started == []
    cluster.post(f"/api/v1/jobs/{j['id']}/resume")
    assert cycle(cluster).started == [j["id"]]
    body = job(cluster, j["id"])
    (a,) = heartbeat(cluster, body["placement"][0]["node"])["assignments"]
    assert (a["attempt"], a["spec"]["resume_from"], a["spec"]["restart_count"]) == (2, "/ckpt/step-40", 1)


def test_suspension_past_grace_is_forced_and_lost_work_recorded(cluster):
    j = cluster.submit(gpus_per_node=2)
    cycle(cluster)
    node = job(cluster, j["id"])["placement"][0]["node"]
    heartbeat(cluster, node, [running(j["id"], 1, [0])])
    cluster.post(f"/api/v1/jobs/{j['id']}/suspend")
    heartbeat(cluster, node, [exited(j["id"], 1, {0: -9}, stopped_reason="no checkpoint within the 60 s grace period")])
    body = job(cluster, j["id"])
    assert body["state"] == "queued" and body["suspensions"] == 1
    assert body["lost_gpu_s"] > 0
    assert "stopped without a checkpoint" in body["events"][-1]["reason"]
    assert body["exit_code"] is None  # a suspension is never a failure


def test_logs_are_stored_per_rank_deduplicated_and_followed(cluster):
    j = cluster.submit(nodes=2)
    cycle(cluster)
    lines = [LogLine(job_id=j["id"], attempt=1, rank=r, seq=s, ts=1.7e9 + s, line=f"rank {r} line {s}") for s in range(2) for r in range(2)]
    batch = LogBatch(node="n0", lines=lines).model_dump(mode="json")
    for _ in range(2):  # a re-sent batch is stored once
        r = cluster.client.post("/api/v1/agent/logs", json=batch, headers=cluster.h(cluster.agent))
        assert r.status_code == 200
    text = cluster.get(f"/api/v1/jobs/{j['id']}/logs").text
    assert text.splitlines() == ["[rank 0] rank 0 line 0", "[rank 1] rank 1 line 0", "[rank 0] rank 0 line 1", "[rank 1] rank 1 line 1"]
    assert cluster.get(f"/api/v1/jobs/{j['id']}/logs", params={"rank": 1}).text.count("\n") == 2
    assert cluster.get(f"/api/v1/jobs/{j['id']}/logs", params={"q": "line 1"}).text.count("\n") == 2
    assert cluster.get(f"/api/v1/jobs/{j['id']}/logs", cluster.bob).status_code == 403
    assert cluster.get("/api/v1/jobs/987654/logs").status_code == 404
    # follow on a finished job: every line, then the end event
    cluster.post(f"/api/v1/jobs/{j['id']}/cancel")
    with cluster.client.stream("GET", f"/api/v1/jobs/{j['id']}/logs", params={"follow": "true"}, headers=cluster.h(cluster.alice)) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        body = resp.read().decode()
    assert body.count("event: log") == 4
    assert "event: end\r\ndata: cancelled" in body or "event: end\ndata: cancelled" in body


def test_unknown_node_is_asked_to_register_and_old_protocol_is_426(cluster):
    assert heartbeat(cluster, "ghost")["reregister"] is True
    hb = Heartbeat(node="n0").model_dump(mode="json")
    hb["protocol_version"] = 99
    r = cluster.client.post("/api/v1/agent/heartbeat", json=hb, headers=cluster.h(cluster.agent))
    assert r.status_code == 426
    assert "not supported" in r.json()["detail"]


def test_logs_survive_a_server_restart(cluster, settings):
    from fastapi.testclient import TestClient

    from hai.main import create_app
    from hai.services.context import Platform

    j = cluster.submit(gpus_per_node=1)
    batch = LogBatch(node="n0", lines=[LogLine(job_id=j["id"], attempt=1, rank=0, seq=0, ts=1.7e9, line="kept")])
    cluster.client.post("/api/v1/agent/logs", json=batch.model_dump(mode="json"), headers=cluster.h(cluster.agent))
    cluster.platform.close()
    fresh = Platform.from_settings(settings)  # a new process would do exactly this
    try:
        with TestClient(create_app(fresh)) as client:
            r = client.get(f"/api/v1/jobs/{j['id']}/logs", headers=cluster.h(cluster.alice))
            assert r.text == "[rank 0] kept\n"
    finally:
        fresh.close()


def test_agents_owning_some_gpus_of_a_host_get_their_own_indices(api):
    """Two agents on one 2-GPU host (`hai agent --gpus 0` / `--gpus 1`) stand for two nodes."""
    from hai.protocol import AgentHello, GpuInfo

    for i in range(2):
        hello = AgentHello(node=f"g{i}", zone="A", leaf=f"A{i + 1}", address="127.0.0.1",
                           gpus=[GpuInfo(index=i, uuid=f"GPU-{i}", model="H200", memory_total_mib=143771)])
        r = api.client.post("/api/v1/agent/register", json=hello.model_dump(mode="json"), headers=api.h(api.agent))
        assert r.status_code == 200
    j = api.submit(nodes=2, gpus_per_node=1, job_type="torch")
    assert cycle(api).started == [j["id"]]
    placement = job(api, j["id"])["placement"]
    assert [(p["node"], p["gpus"]) for p in placement] == [("g0", [0]), ("g1", [1])]
    (a1,) = heartbeat(api, "g1")["assignments"]
    assert a1["spec"]["gpus"] == [1]
    # held GPUs are seen as held: a second job does not fit
    api.submit(gpus_per_node=1)
    assert cycle(api).started == []


def test_ranks_that_fenced_themselves_requeue_the_job_instead_of_failing_it(cluster):
    """Issue 13: the agent reached the server again before the server had marked the node lost,
    and reports ranks stopped by their lease (exit 143, stop cause 'fenced'): a restart, as if
    the server had found the node lost; the other node's ranks are stopped."""
    j = cluster.submit(nodes=2, gpus_per_node=8, job_type="torch")
    assert cycle(cluster).started == [j["id"]]
    for n, base in (("n0", 0), ("n1", 8)):
        heartbeat(cluster, n, [running(j["id"], 1, list(range(base, base + 8)), local=True)])
    assert job(cluster, j["id"])["state"] == "running"
    fenced = exited(j["id"], 1, {r: 143 for r in range(8, 16)}, finished=True, stop_cause="fenced",
                    stopped_reason="the agent did not reach the server within its lease")
    heartbeat(cluster, "n1", [fenced])
    body = job(cluster, j["id"])
    assert body["state"] == "queued" and body["restarts"] == 1 and body["exit_code"] is None
    assert "lost the server past its lease" in body["events"][-1]["reason"]
    (a,) = heartbeat(cluster, "n0", [running(j["id"], 1, list(range(8)), local=True)])["assignments"]
    assert a["action"] == "stop"
