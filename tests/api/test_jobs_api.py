from __future__ import annotations

import pytest
from sqlalchemy import func, select

from hai.db.models import Job, JobEvent
from hai.schemas.common import NodeRead


def _job_count(api) -> tuple[int, int]:
    with api.platform.sessions() as s:
        return s.scalar(select(func.count(Job.id))), s.scalar(select(func.count(JobEvent.id)))


@pytest.fixture
def cluster(api):
    for i, (zone, leaf) in enumerate([("A", "A1"), ("A", "A2"), ("B", "B1"), ("B", "B2")]):
        api.register_node(f"n{i}", zone=zone, leaf=leaf)
    return api


def test_submit_returns_201_with_the_job(cluster):
    body = {
        "name": "train-resnet",
        "command": ["python", "train.py", "--lr", "0.1"],
        "nodes": 2,
        "gpus_per_node": 8,
        "priority": "HIGH",
        "env": {"SEED": "1"},
        "job_type": "torch",
        "max_runtime_s": 3600,
        "tags": ["resnet", "ci"],
    }
    r = cluster.post("/api/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["id"] > 0
    for key in ("name", "command", "nodes", "gpus_per_node", "priority", "env", "job_type", "max_runtime_s", "tags"):
        assert job[key] == body[key], key
    assert job["user"] == "alice" and job["group"] == "vision"
    assert job["state"] == "queued"
    assert job["started_at"] is None and job["finished_at"] is None and job["exit_code"] is None
    assert job["placement"] == [] and job["suspensions"] == 0
    assert job["pending_reason"]
    assert [(e["from_state"], e["to_state"], e["reason"]) for e in job["events"]] == [(None, "queued", "submitted")]


def test_submit_defaults(cluster):
    job = cluster.submit(name="d", command=["true"])
    assert (job["nodes"], job["gpus_per_node"], job["priority"], job["job_type"], job["env"], job["tags"]) == (
        1, 8, "NORMAL", "command", {}, [],
    )


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"nodes": 0}, "nodes"),
        ({"gpus_per_node": 0}, "gpus_per_node"),
        ({"gpus_per_node": 9}, "gpus_per_node"),
        ({"priority": "URGENT"}, "priority"),
        ({"command": []}, "command"),
        ({"command": [""]}, "command"),
        ({"job_type": "mpi"}, "job_type"),
        ({"name": ""}, "name"),
        ({"name": "x" * 129}, "name"),
        ({"nodes": 5}, "nodes"),  # the cluster has 4 nodes
        ({"nodes": 2, "gpus_per_node": 4}, "gpus_per_node"),  # multi-node jobs take whole nodes
        ({"env": {"A=B": "1"}}, "env"),
        ({"surprise": 1}, "surprise"),
        ({"max_runtime_s": 0}, "max_runtime_s"),
    ],
)
def test_invalid_job_is_422_with_field_and_writes_nothing(cluster, patch, field):
    body = {"name": "bad", "command": ["true"], **patch}
    before = _job_count(cluster)
    r = cluster.post("/api/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(field in [str(x) for x in d["loc"]] for d in detail), detail
    assert all(d["msg"] for d in detail)
    assert _job_count(cluster) == before


def test_submit_on_an_empty_cluster_is_refused(api):
    r = api.post("/api/v1/jobs", json={"name": "x", "command": ["true"]})
    assert r.status_code == 422
    assert "cluster has 0 node" in r.json()["detail"][0]["msg"]


def test_list_filters_and_pages(cluster):
    a1 = cluster.submit(name="a1")
    a2 = cluster.submit(name="a2")
    b1 = cluster.submit(cluster.bob, name="b1")
    cluster.post(f"/api/v1/jobs/{a2['id']}/cancel")
    everything = cluster.get("/api/v1/jobs").json()
    assert everything["total"] == 3
    assert [j["id"] for j in everything["items"]] == [b1["id"], a2["id"], a1["id"]]
    assert [j["id"] for j in cluster.get("/api/v1/jobs", params={"state": "queued"}).json()["items"]] == [b1["id"], a1["id"]]
    assert cluster.get("/api/v1/jobs", params={"user": "bob"}).json()["total"] == 1
    page = cluster.get("/api/v1/jobs", params={"limit": 1, "offset": 1}).json()
    assert page["total"] == 3 and [j["id"] for j in page["items"]] == [a2["id"]]
    assert cluster.get("/api/v1/jobs", params={"state": "sleeping"}).status_code == 422
    assert cluster.get("/api/v1/jobs", params={"limit": 0}).status_code == 422


def test_list_keyset_pages_and_totals(cluster):
    ids = [cluster.submit(name=f"k{i}")["id"] for i in range(5)]
    b = cluster.submit(cluster.bob, name="kb")["id"]
    first = cluster.get("/api/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in first["items"]] == [b, ids[4]] and first["total"] == 6
    second = cluster.get("/api/v1/jobs", params={"limit": 2, "before_id": ids[4]}).json()
    assert [j["id"] for j in second["items"]] == [ids[3], ids[2]] and second["total"] == 6
    last = cluster.get("/api/v1/jobs", params={"limit": 50, "before_id": ids[2], "user": "alice"}).json()
    assert [j["id"] for j in last["items"]] == [ids[1], ids[0]] and last["total"] == 5
    past = cluster.get("/api/v1/jobs", params={"limit": 2, "offset": 10}).json()
    assert past["items"] == [] and past["total"] == 6
    tail = cluster.get("/api/v1/jobs", params={"limit": 4, "offset": 4}).json()
    assert [j["id"] for j in tail["items"]] == [ids[1], ids[0]] and tail["total"] == 6
    r = cluster.get("/api/v1/jobs", params={"before_id": 0})
    assert r.status_code == 422 and "before_id" in str(r.json()["detail"][0]["loc"])


def test_get_job_404_and_403_and_admin_may(cluster):
    job = cluster.submit(name="mine")
    assert cluster.get("/api/v1/jobs/999999").status_code == 404
    assert cluster.get(f"/api/v1/jobs/{job['id']}", cluster.bob).status_code == 403
    assert cluster.get(f"/api/v1/jobs/{job['id']}", cluster.admin).json()["name"] == "mine"


def test_cancel_queued_then_cancel_again_is_409(cluster):
    job = cluster.submit()
    assert cluster.post(f"/api/v1/jobs/{job['id']}/cancel", cluster.bob).status_code == 403
    r = cluster.post(f"/api/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200
    body = r.json()
    assert body["state"] == "cancelled" and body["finished_at"] is not None
    assert body["events"][-1]["reason"] == "cancelled by alice"
    again = cluster.post(f"/api/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 409
    assert "cancelled" in again.json()["detail"]
    assert cluster.post("/api/v1/jobs/424242/cancel").status_code == 404


def test_admin_may_cancel_anyones_job(cluster):
    job = cluster.submit()
    assert cluster.post(f"/api/v1/jobs/{job['id']}/cancel", cluster.admin).json()["state"] == "cancelled"


def test_suspend_and_resume_a_queued_job_holds_it(cluster):
    job = cluster.submit()
    r = cluster.post(f"/api/v1/jobs/{job['id']}/suspend")
    assert r.status_code == 200 and r.json()["held"] is True and r.json()["state"] == "queued"
    assert cluster.post(f"/api/v1/jobs/{job['id']}/suspend").status_code == 409
    r = cluster.post(f"/api/v1/jobs/{job['id']}/resume")
    assert r.status_code == 200 and r.json()["held"] is False
    assert cluster.post(f"/api/v1/jobs/{job['id']}/resume").status_code == 409


def test_nodes_list_shows_topology_and_free_gpus(cluster):
    nodes = cluster.get("/api/v1/nodes").json()
    assert [(n["name"], n["zone"], n["leaf"], n["gpus"], n["free_gpus"], n["state"]) for n in nodes] == [
        ("n0", "A", "A1", 8, 8, "ready"),
        ("n1", "A", "A2", 8, 8, "ready"),
        ("n2", "B", "B1", 8, 8, "ready"),
        ("n3", "B", "B2", 8, 8, "ready"),
    ]
    assert all(n["running_jobs"] == [] for n in nodes)
    # per-GPU figures: in the node's own view, and in the list only when asked (issue 12)
    assert all(n["gpu_metrics"] is None for n in nodes)
    assert nodes == [NodeRead.model_validate(n).model_dump(mode="json") for n in nodes]  # served unvalidated
    full = cluster.get("/api/v1/nodes", params={"include": "gpu_metrics"}).json()
    assert [g["index"] for g in full[0]["gpu_metrics"]] == list(range(8))
    assert [{k: v for k, v in n.items() if k != "gpu_metrics"} for n in full] == [
        {k: v for k, v in n.items() if k != "gpu_metrics"} for n in nodes]
    assert cluster.get("/api/v1/nodes/n0").json()["gpu_metrics"] == full[0]["gpu_metrics"]
    r = cluster.get("/api/v1/nodes", params={"include": "everything"})
    assert r.status_code == 422 and "include" in str(r.json()["detail"][0]["loc"])
