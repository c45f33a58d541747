"""A heartbeat builds the node's assignments once, and an agent that holds them and no longer
reports a stopped attempt gets its GPUs released."""

from __future__ import annotations

import pytest
from sqlalchemy import event

from hai.protocol import AttemptStatus, Heartbeat, RankStatus
from hai.services import assignments
from hai.services.scheduling import run_cycle


def cycle(api):
    with api.platform.sessions() as s:
        return run_cycle(s, settings=api.platform.settings)


def heartbeat(api, node: str, attempts=(), digest: str | None = None) -> dict:
    hb = Heartbeat(node=node, attempts=list(attempts), assignments_digest=digest)
    r = api.client.post("/api/v1/agent/heartbeat", json=hb.model_dump(mode="json"), headers=api.h(api.agent))
    assert r.status_code == 200, r.text
    return r.json()


def running(job_id: int, attempt: int = 1) -> AttemptStatus:
    return AttemptStatus(job_id=job_id, attempt=attempt, ranks=[RankStatus(rank=0, local_rank=0, pid=100)])


@pytest.fixture
def counted(api, monkeypatch):
    """Statements that read the node's allocations (the ORM pass's ``active_allocations`` or the
    quiet pass's one statement, issue 12), and assignments built."""
    calls = {"queries": 0, "assignments": 0}
    real_build = assignments.assignment_of

    def statement(conn, cursor, sql, params, context, executemany):  # noqa: ANN001, ANN202
        if sql.lstrip().upper().startswith("SELECT") and "job_allocations" in sql:
            calls["queries"] += 1

    def build(*a, **kw):
        calls["assignments"] += 1
        return real_build(*a, **kw)

    event.listen(api.platform.engine, "before_cursor_execute", statement)
    monkeypatch.setattr(assignments, "assignment_of", build)
    yield calls
    event.remove(api.platform.engine, "before_cursor_execute", statement)


def test_a_heartbeat_builds_each_assignment_once(api, counted):
    api.register_node("n0")
    jobs = [api.submit(gpus_per_node=2)["id"] for _ in range(3)]
    cycle(api)
    first = heartbeat(api, "n0", [running(j) for j in jobs])
    assert [a["action"] for a in first["assignments"]] == ["run"] * 3
    counted.update(queries=0, assignments=0)
    # the agent holds the current list (its digest matches): one query, one build per allocation
    again = heartbeat(api, "n0", [running(j) for j in jobs], digest=first["assignments_digest"])
    assert again["assignments_digest"] == first["assignments_digest"]
    assert counted == {"queries": 1, "assignments": 3}


def test_an_unreported_stop_is_released_once_the_agent_holds_it(api):
    api.register_node("n0")
    j = api.submit(gpus_per_node=8)["id"]
    cycle(api)
    heartbeat(api, "n0", [running(j)])
    api.post(f"/api/v1/jobs/{j}/cancel")
    stop = heartbeat(api, "n0", [running(j)])
    assert [a["action"] for a in stop["assignments"]] == ["stop"]
    # an agent that has not seen the stop (old digest) and reports nothing keeps the GPUs held
    heartbeat(api, "n0", [], digest="an older digest")
    assert api.get("/api/v1/nodes").json()[0]["free_gpus"] == 0
    # the agent applied the stop, the ranks are gone and it forgot the attempt: released
    reply = heartbeat(api, "n0", [], digest=stop["assignments_digest"])
    assert reply["assignments"] == []
    assert api.get("/api/v1/nodes").json()[0]["free_gpus"] == 8
