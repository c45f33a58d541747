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
