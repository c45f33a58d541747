"""Reading a job's log through the API: a refused read is refused before any stream starts,
and a followed log of a running job streams lines as they arrive and ends with the state."""

from __future__ import annotations

import json
import threading

from hai.protocol import AttemptStatus, Heartbeat, LogBatch, LogLine, RankStatus
from hai.services.scheduling import run_cycle


def _agent_post(api, path: str, msg) -> None:
    r = api.client.post(f"/api/v1/agent/{path}", json=msg.model_dump(mode="json"), headers=api.h(api.agent))
    assert r.status_code == 200, r.text


def test_following_a_missing_or_foreign_job_is_refused_before_the_stream(api):
    api.register_node("n0")
    job = api.submit(gpus_per_node=1)
    assert api.get("/api/v1/jobs/999999/logs", params={"follow": "true"}).status_code == 404
    r = api.get(f"/api/v1/jobs/{job['id']}/logs", api.bob, params={"follow": "true"})
    assert r.status_code == 403 and "text/event-stream" not in r.headers.get("content-type", "")


def test_a_followed_log_streams_new_lines_and_ends_with_the_final_state(api):
    api.register_node("n0")
    j = api.submit(gpus_per_node=1)["id"]
    with api.platform.sessions() as s:
        run_cycle(s, settings=api.platform.settings)
    _agent_post(api, "heartbeat", Heartbeat(node="n0", attempts=[AttemptStatus(
        job_id=j, attempt=1, ranks=[RankStatus(rank=0, local_rank=0, pid=1)])]))
    _agent_post(api, "logs", LogBatch(node="n0", lines=[LogLine(job_id=j, attempt=1, rank=0, seq=0, ts=1.0, line="one")]))
    events: list[tuple[str, str]] = []
    first = threading.Event()

    def later():  # a second line, then the job ends
        assert first.wait(20)
        _agent_post(api, "logs", LogBatch(node="n0", lines=[LogLine(job_id=j, attempt=1, rank=0, seq=1, ts=2.0, line="two")]))
        _agent_post(api, "heartbeat", Heartbeat(node="n0", attempts=[AttemptStatus(
            job_id=j, attempt=1, finished=True, ranks=[RankStatus(rank=0, local_rank=0, state="exited", exit_code=0)])]))

    t = threading.Thread(target=later, daemon=True)
    t.start()
    with api.client.stream("GET", f"/api/v1/jobs/{j}/logs", params={"follow": "true"}, headers=api.h(api.alice)) as resp:
        assert resp.status_code == 200
        kind = None
        for raw in resp.iter_lines():
            if raw.startswith("event:"):
                kind = raw.split(":", 1)[1].strip()
            elif raw.startswith("data:") and kind in ("log", "end"):
                events.append((kind, raw.split(":", 1)[1].strip()))
                first.set()
                if kind == "end":
                    break
    t.join(20)
    assert events == [("log", "[rank 0] one"), ("log", "[rank 0] two"), ("end", "succeeded")], json.dumps(events)
