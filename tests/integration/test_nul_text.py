"""Text a client sends with a NUL character (issue 13's bad input, found on PostgreSQL): its text
holds no NUL, and psycopg refuses to send one, which was a 500 there (and a 201 on SQLite). A
request field or a URL with one is a 422 naming where, on both databases, writing nothing; a job's
log line with one (a job that prints binary) is stored with U+FFFD in its place."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select

from hai.db.models import ApiToken
from tests.integration.test_submit_pg import BODY, _counts, make_api  # noqa: F401 - make_api: the fixture


@pytest.mark.parametrize(
    ("path", "body", "loc"),
    [
        ("/api/v1/jobs", BODY | {"name": "a\x00b"}, ["body", "name"]),
        ("/api/v1/jobs", BODY | {"tags": ["ok", "t\x00"]}, ["body", "tags", 1]),
        ("/api/v1/jobs/batch", {"jobs": [BODY, BODY | {"name": "\x00"}]}, ["body", "jobs", 1, "name"]),
        ("/api/v1/tokens", {"name": "ci\x00"}, ["body", "name"]),
        ("/api/v1/nodes/n0/drain", {"reason": "bad\x00fan"}, ["body", "reason"]),
        ("/api/v1/quotas", {"items": [{"group": "vision", "priority": "HIGH", "user": "a\x00", "gpus": 8}]},
         ["body", "items", 0, "user"]),
    ],
)
def test_text_with_a_nul_character_is_422_on_every_database_and_writes_nothing(make_api, path, body, loc):
    """PostgreSQL's text holds no NUL (psycopg refuses to send one): a job's name with one was a
    500 there and a 201 on SQLite; now a 422 naming the field on both, with or without a cached
    credential (the early submission and the route)."""
    api = make_api()
    api.register_node("n0")
    token = api.admin if "drain" in path or "quotas" in path else api.alice
    api.get("/api/v1/jobs", token)  # the credential cached: a submission is answered early
    for _ in range(2):
        r = api.client.request("PUT" if "quotas" in path else "POST", path, json=body, headers=api.h(token))
        assert r.status_code == 422, r.text
        detail = r.json()["detail"][0]
        assert (detail["loc"], detail["msg"]) == (loc, "Value error, must not contain NUL characters")
        api.client.app.state.token_cache = None  # the second time: the route's own answer
    assert _counts(api) == (0, 0, 0)
    assert api.get("/api/v1/nodes/n0", api.admin).json()["state"] != "drained"
    with api.platform.sessions() as s:
        assert s.scalar(select(func.count(ApiToken.id))) == 4  # admin, alice, bob, the agents'
    assert api.get("/api/v1/quotas").json()["items"] == []


@pytest.mark.parametrize(
    ("method", "url", "loc"),
    [
        ("GET", "/api/v1/jobs?user=a%00b", ["query", "user"]),
        ("GET", "/api/v1/jobs?limit=5&user=%00", ["query", "user"]),
        ("GET", "/api/v1/nodes/n%000", ["path"]),
        ("POST", "/api/v1/nodes/n%000/drain", ["path"]),
    ],
)
def test_a_nul_character_in_the_url_is_422_naming_where(make_api, method, url, loc):
    """A look-up by a name with a NUL (PostgreSQL: psycopg refuses to send it) was a 500."""
    api = make_api()
    api.register_node("n0")
    r = api.client.request(method, url, headers=api.h(api.admin), json={"reason": "bad fan"} if method == "POST" else None)
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == [{"loc": loc, "type": "value_error", "msg": "must not contain NUL characters"}]
    assert api.get("/api/v1/nodes/n0", api.admin).json()["state"] == "ready"


def test_a_log_line_with_a_nul_is_stored_with_a_replacement_character(make_api):
    """A NUL in one job's output failed the node's whole log batch on PostgreSQL (500, retried by the
    agent, every job's lines of the node held behind it); now the batch is stored, the NUL as U+FFFD
    (as the agent stores bytes that are not UTF-8), on both databases."""
    api = make_api()
    api.register_node("n0")
    job = api.submit(name="binary", command=["cat", "/dev/urandom"], gpus_per_node=1)
    other = api.submit(name="other", command=["echo"], gpus_per_node=1)
    lines = [{"job_id": job["id"], "attempt": 0, "rank": 0, "seq": 0, "ts": time.time(), "line": "start"},
             {"job_id": job["id"], "attempt": 0, "rank": 0, "seq": 1, "ts": time.time(), "line": "bin\x00ary\x00"},
             {"job_id": other["id"], "attempt": 0, "rank": 0, "seq": 0, "ts": time.time(), "line": "other's line"}]
    r = api.client.post("/api/v1/agent/logs", json={"node": "n0", "lines": lines}, headers=api.h(api.agent))
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == 3
    got = api.get(f"/api/v1/jobs/{job['id']}/logs").text
    assert "start" in got and "bin\ufffdary\ufffd" in got and "\x00" not in got
    assert "other's line" in api.get(f"/api/v1/jobs/{other['id']}/logs").text


def _hello(name: str = "n9", **kw) -> dict:  # noqa: ANN003
    from hai.protocol import AgentHello, GpuInfo

    body = AgentHello(node=name, zone="A", leaf="A1", address="127.0.0.1", fake_gpus=True,
                      gpus=[GpuInfo(index=0, uuid="GPU-0", model="Fake", memory_total_mib=81920)]).model_dump(mode="json")
    return body | kw


@pytest.mark.parametrize(
    ("change", "loc"),
    [
        ({"node": "n\x009"}, ["body", "node"]),
        ({"leaf": "A\x001"}, ["body", "leaf"]),
        ({"gpus": [{"index": 0, "uuid": "GPU-\x00", "model": "Fake", "memory_total_mib": 81920}]},
         ["body", "gpus", 0, "uuid"]),
    ],
)
def test_an_agent_that_names_itself_with_a_nul_is_422_and_registers_nothing(make_api, change, loc):
    """An agent's identity (its node, zone, leaf, address, GPUs' ids): with a NUL a clear 422
    naming the field, never a node half-registered (PostgreSQL: it was a 500)."""
    api = make_api()
    r = api.client.post("/api/v1/agent/register", json=_hello(**change), headers=api.h(api.agent))
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == loc
    assert "NUL" in r.json()["detail"][0]["msg"]
    assert api.get("/api/v1/nodes", api.admin).json() == []


def test_what_an_agent_saw_with_a_nul_is_stored_with_a_replacement_character(make_api):
    """What an agent reports having seen (a check's detail, a launch error, why it stopped ranks)
    comes from the machine and may hold any byte: a NUL there is stored as U+FFFD, and the
    heartbeat is answered (on PostgreSQL it was a 500 every second: the node went lost)."""
    from hai.protocol import CheckResult, Heartbeat, ValidationReport

    api = make_api()
    api.platform.settings.validation.quick_every_heartbeats = 3
    api.register_node("n0")
    at = time.time()
    report = ValidationReport(run_id=None, level="quick", started_at=at, finished_at=at + 0.5, checks=[
        CheckResult(name="gpu_xid", level="quick", critical=True, status="passed", value=0, threshold=0,
                    unit="hardware Xid\x00 events", detail="dmesg said: \x00\x00 nothing"),
    ])
    hb = Heartbeat(node="n0", validations=[report])
    r = api.client.post("/api/v1/agent/heartbeat", json=hb.model_dump(mode="json"), headers=api.h(api.agent))
    assert r.status_code == 200, r.text
    cache = getattr(api.client.app.state, "reply_cache", None)
    if cache is not None:
        cache.flush()
    (run,) = api.get("/api/v1/nodes/n0/validations", api.admin).json()
    (check,) = run["checks"]
    assert (check["detail"], check["unit"]) == ("dmesg said: \ufffd\ufffd nothing", "hardware Xid\ufffd events")
