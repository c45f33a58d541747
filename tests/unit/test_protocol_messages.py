"""The agent protocol messages: round-trips, versions, tolerance of newer peers."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from hai.protocol import (
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    AgentHello,
    Assignment,
    AttemptStatus,
    CheckpointInfo,
    GpuInfo,
    GpuMetrics,
    Heartbeat,
    LaunchSpec,
    LogBatch,
    LogLine,
    NicInfo,
    ProgressInfo,
    RankStatus,
    ServerReply,
)


def _spec(**kw) -> LaunchSpec:
    base = dict(job_name="j", user="u", command=["python", "train.py"], gpus=[0, 1], node_rank=0, nnodes=2,
                gpus_per_node=2, master_addr="10.0.0.1", master_port=29500)
    base.update(kw)
    return LaunchSpec(**base)


def _status() -> AttemptStatus:
    return AttemptStatus(
        job_id=7, attempt=2,
        ranks=[RankStatus(rank=0, local_rank=0, pid=123), RankStatus(rank=1, local_rank=1, state="exited", exit_code=0)],
        suspend_ready=True, stopped_reason="stopped after suspend_ready()", stop_cause="suspend", finished=False,
        checkpoint=CheckpointInfo(path="/ck/ckpt-000000000010.pt", step=10, at=1.5, duration_s=0.25),
        progress=ProgressInfo(step=10, total=100, metrics={"loss": 0.5}, at=2.0),
        started_at=1.0, suspend_requested_at=1.2,
    )


@pytest.mark.parametrize("msg", [
    AgentHello(node="n1", zone="A", leaf="A-1", address="10.0.0.1",
               gpus=[GpuInfo(index=0, uuid="GPU-x", model="A100", memory_total_mib=40960, numa_node=0)],
               nics=[NicInfo(name="mlx5_0", numa_node=0)], fake_gpus=True, attempts=[_status()]),
    Heartbeat(node="n1", gpus=[GpuMetrics(index=0, uuid="GPU-x", util_pct=93.5, memory_used_mib=1000,
                                          memory_total_mib=40960, temperature_c=60, power_w=250,
                                          ecc_uncorrected=0)],
              attempts=[_status()], wait_s=10, assignments_digest="abc"),
    ServerReply(node="n1", assignments=[Assignment(job_id=7, attempt=2, action="suspend",
                                                   spec=_spec(resume_from="/ck/x.pt", cwd="/work",
                                                              stop_grace_s=5.0))],
                assignments_digest="d1", heartbeat_interval_s=0.5),
    LogBatch(node="n1", lines=[LogLine(job_id=7, attempt=2, rank=1, seq=0, ts=1.0, line="hello"),
                               LogLine(job_id=7, attempt=2, rank=1, seq=1, ts=1.1, stream="system",
                                       line="[hai] 3 lines dropped (log buffer full)")]),
])
def test_messages_round_trip_through_json(msg):
    again = type(msg).model_validate_json(msg.model_dump_json())
    assert again == msg


def test_every_envelope_carries_the_protocol_version():
    assert PROTOCOL_VERSION in SUPPORTED_VERSIONS
    hello = AgentHello(node="n", address="a", gpus=[])
    assert hello.protocol_version == PROTOCOL_VERSION
    assert Heartbeat(node="n").protocol_version == PROTOCOL_VERSION
    assert ServerReply(node="n", assignments_digest="").protocol_version == PROTOCOL_VERSION
    assert LogBatch(node="n").protocol_version == PROTOCOL_VERSION
    assert '"protocol_version":%d' % PROTOCOL_VERSION in hello.model_dump_json()


def test_unknown_fields_from_newer_peers_are_ignored():
    data = _status().model_dump()
    data["some_future_field"] = {"x": 1}
    st = AttemptStatus.model_validate(data)
    assert st == _status()


def test_fields_added_by_the_agent_are_optional_for_older_peers():
    st = AttemptStatus(job_id=1, attempt=0)
    assert st.finished is False and st.stop_cause is None and st.started_at is None
    spec = _spec()
    assert spec.cwd is None and spec.stop_grace_s is None


@pytest.mark.parametrize("bad", [
    lambda: Heartbeat(node="n", wait_s=61),
    lambda: Heartbeat(node="n", wait_s=-1),
    lambda: Assignment(job_id=1, attempt=0, action="explode", spec=_spec()),
    lambda: LaunchSpec(job_name="j", user="u", command=["x"], job_type="mpi", gpus=[], node_rank=0, nnodes=1,
                       gpus_per_node=1, master_addr="a", master_port=1),
    lambda: RankStatus(rank=0, local_rank=0, state="zombie"),
    lambda: LogLine(job_id=1, attempt=0, rank=0, seq=0, ts=0, stream="stdin", line=""),
])
def test_invalid_messages_are_refused(bad):
    with pytest.raises(ValidationError):
        bad()


# -- JSON types: true/false is not a number, a number is not true/false (issue 13; the rules are
# worked out once per message class since issue 12, and must stay the same) ----------------------
@pytest.mark.parametrize("body, field", [
    ({"node": "n", "gpus": [{"index": True, "uuid": "G0"}]}, "index: a number is expected, not true"),
    ({"node": "n", "gpus": [{"index": 0, "uuid": "G0", "util_pct": False}]}, "util_pct: a number is expected"),
    ({"node": "n", "wait_s": True}, "wait_s: a number is expected"),
    ({"node": "n", "attempts": [{"job_id": 1, "attempt": 1, "suspend_ready": 1}]},
     "suspend_ready: true or false is expected, not 1"),
    ({"node": "n", "attempts": [{"job_id": 1, "attempt": 1, "finished": "yes"}]},
     "finished: true or false is expected"),
    ({"node": "n", "attempts": [{"job_id": 1, "attempt": 1,
                                 "progress": {"step": 1, "at": 1.0, "metrics": {"loss": True}}}]},
     "metrics: numbers are expected, not true/false"),
])
def test_heartbeat_refuses_json_booleans_for_numbers_and_numbers_for_booleans(body, field):
    with pytest.raises(ValidationError) as e:
        Heartbeat.model_validate_json(json.dumps(body))
    assert field in str(e.value)


def test_heartbeat_keeps_numbers_booleans_and_nulls_it_is_given():
    hb = Heartbeat.model_validate_json(json.dumps({
        "node": "n", "wait_s": 0, "gpus": [{"index": 0, "uuid": "G0", "util_pct": 50, "temperature_c": None}],
        "attempts": [{"job_id": 1, "attempt": 2, "suspend_ready": True,
                      "progress": {"step": 3, "at": 1.5, "metrics": {"loss": 0.5}}}]}))
    assert hb.gpus[0].util_pct == 50.0 and hb.gpus[0].temperature_c is None
    assert hb.attempts[0].suspend_ready is True and hb.attempts[0].progress.metrics == {"loss": 0.5}
