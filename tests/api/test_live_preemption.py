"""Live scheduling through the service and the agent protocol: a HIGH job submitted to a full
cluster suspends the right LOW job at its checkpoint and starts on the GPUs it frees."""

from __future__ import annotations

import time

import pytest

from hai.protocol import AttemptStatus, CheckpointInfo, RankStatus
from tests.api.test_agent_protocol_api import cycle, exited, heartbeat, running


def job(api, job_id: int) -> dict:
    return api.get(f"/api/v1/jobs/{job_id}", api.admin).json()


@pytest.fixture
def full_cluster(api):
    api.platform.settings.scheduler.min_runtime_s = 0
    api.register_node("n0", zone="A", leaf="A1")
    api.register_node("n1", zone="A", leaf="A2")
    low_a = api.submit(api.bob, name="low-a", priority="LOW")
    low_b = api.submit(api.bob, name="low-b", priority="LOW")
    assert sorted(cycle(api).started) == sorted([low_a["id"], low_b["id"]])
    nodes = {}
    for j in (low_a, low_b):
        node = job(api, j["id"])["placement"][0]["node"]
        nodes[j["id"]] = node
        heartbeat(api, node, [running(j["id"], 1, [0])])
    return api, low_a["id"], low_b["id"], nodes


def test_high_job_suspends_the_low_job_that_loses_least_and_takes_its_node(full_cluster):
    api, low_a, low_b, nodes = full_cluster
    # low-a checkpointed a moment ago; low-b never did: suspending low-a loses the least work
    ckpt = CheckpointInfo(path="/ckpt/a-7", step=7, at=time.time(), duration_s=1.0)
    heartbeat(api, nodes[low_a], [AttemptStatus(job_id=low_a, attempt=1, checkpoint=ckpt,
                                                ranks=[RankStatus(rank=0, local_rank=0, pid=1)])])
    high = api.submit(api.alice, name="urgent", priority="HIGH")
    result = cycle(api)
    assert result.started == [] and result.suspended == [low_a]
    a = job(api, low_a)
    assert a["state"] == "suspending"
    assert f"job {high['id']}" in a["events"][-1]["reason"] or "HIGH" in a["events"][-1]["reason"]
    assert job(api, low_b)["state"] == "running"
    waiting = job(api, high["id"])
    assert waiting["state"] == "queued" and "checkpoint" in waiting["pending_reason"]
    # nothing else may take the GPUs being freed for the HIGH job
    api.submit(api.bob, name="sneaky", priority="LOW", gpus_per_node=1)
    assert cycle(api).started == []
    # low-a reaches its checkpoint and stops; the HIGH job starts on its node
    (assignment,) = heartbeat(api, nodes[low_a], [running(low_a, 1, [0])])["assignments"]
    assert assignment["action"] == "suspend"
    heartbeat(api, nodes[low_a], [exited(low_a, 1, {0: 0}, suspend_ready=True, checkpoint=ckpt)])
    assert job(api, low_a)["state"] == "queued" and job(api, low_a)["suspensions"] == 1
    assert cycle(api).started == [high["id"]]
    assert job(api, high["id"])["placement"][0]["node"] == nodes[low_a]
    # the suspended LOW job keeps its place in line: when low-b ends, it resumes before the
    # LOW job submitted after it
    heartbeat(api, nodes[low_b], [exited(low_b, 1, {0: 0})])
    assert job(api, low_b)["state"] == "succeeded"
    assert cycle(api).started == [low_a]
    assert job(api, low_a)["attempt"] == 2
