"""Limits against abuse (issue 13), each a clear 4xx that writes nothing: body size (413),
command and environment size (422 on the field), queued jobs per user (429), failed
authentications per client (429 with Retry-After); tokens: never in the query string, expiry."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select, update

from hai.db.models import ApiToken, Job
from hai.schemas.jobs import MAX_COMMAND_BYTES, MAX_ENV_BYTES
from hai.settings import LimitsSettings, Settings

BODY = {"name": "j", "command": ["echo", "hi"], "gpus_per_node": 1}


@pytest.fixture
def settings(tmp_path) -> Settings:
    limits = LimitsSettings(max_body_bytes=200_000, max_queued_jobs_per_user=3, auth_failures=4, auth_failure_window_s=600,
                            max_log_line_chars=100)
    return Settings(data_dir=tmp_path / "hai", frontend_dist=tmp_path / "no-dashboard", limits=limits)


def _jobs(api) -> int:
    with api.platform.sessions() as s:
        return s.scalar(select(func.count(Job.id)))


def test_a_body_over_the_limit_is_413(api):
    api.register_node("n0")
    big = BODY | {"tags": ["x" * 250_000]}
    r = api.post("/api/v1/jobs", json=big)
    assert r.status_code == 413, r.text
    assert "at most 200000" in r.json()["detail"]
    assert _jobs(api) == 0


def test_a_chunked_body_over_the_limit_is_413(api):
    api.register_node("n0")
    chunks = iter([b'{"name": "j", "command": ["', b"x" * 150_000, b"x" * 150_000, b'"]}'])
    r = api.client.post("/api/v1/jobs", content=chunks, headers=api.h(api.alice) | {"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert _jobs(api) == 0


def test_a_chunked_body_under_the_limit_is_accepted(api):
    api.register_node("n0")
    chunks = iter([b'{"name": "j", "command": ', b'["echo", "hi"], "gpus_per_node": 1}'])
    r = api.client.post("/api/v1/jobs", content=chunks, headers=api.h(api.alice) | {"content-type": "application/json"})
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"command": ["python"] + ["a" * 1000] * (MAX_COMMAND_BYTES // 1000 + 1)}, "command"),
        ({"env": {f"V{i}": "v" * 1000 for i in range(MAX_ENV_BYTES // 1000 + 1)}}, "env"),
        ({"command": ["echo", "a\0b"]}, "command"),
    ],
)
def test_command_and_environment_size_are_422_on_the_field(api, patch, field):
    api.register_node("n0")
    r = api.post("/api/v1/jobs", json=BODY | patch)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"][:2] == ["body", field]
    assert _jobs(api) == 0


def test_queued_jobs_per_user_are_limited(api):
    api.register_node("n0")
    for _ in range(3):
        api.submit(**BODY)
    r = api.post("/api/v1/jobs", json=BODY)
    assert r.status_code == 429, r.text
    assert "3 queued job(s)" in r.json()["detail"] and "MAX_QUEUED_JOBS_PER_USER" in r.json()["detail"]
    assert _jobs(api) == 3
    api.submit(api.bob, **BODY)  # the limit is per user
    cancel = api.post(f"/api/v1/jobs/{api.get('/api/v1/jobs').json()['items'][-1]['id']}/cancel")
    assert cancel.status_code == 200
    api.submit(**BODY)  # a cancelled job frees a place


def test_failed_authentications_are_rate_limited_per_client(api):
    for i in range(4):
        r = api.get("/api/v1/me", f"hai_wrong{i}")
        assert r.status_code == 401, r.text
    r = api.get("/api/v1/me", "hai_wrong-again")
    assert r.status_code == 429, r.text
    retry = int(r.headers["Retry-After"])
    assert 1 <= retry <= 600
    assert "too many failed authentications" in r.json()["detail"]
    # while locked out, even a right token is refused: a guesser learns nothing
    assert api.get("/api/v1/me").status_code == 429


def test_a_missing_token_is_not_counted_as_a_failed_guess(api):
    for _ in range(10):
        assert api.client.get("/api/v1/me").status_code == 401
    assert api.get("/api/v1/me").status_code == 200


@pytest.mark.parametrize("name", ["token", "access_token", "api_key"])
def test_tokens_are_never_accepted_in_the_query_string(api, name):
    r = api.client.get("/api/v1/me", params={name: api.alice})
    assert r.status_code == 400, r.text
    assert r.json()["detail"][0]["loc"] == ["query", name]
    # even alongside a valid header: the request is refused, not served
    assert api.get("/api/v1/me", params={name: api.alice}).status_code == 400


def test_tokens_expire(api):
    # the test moves the expiry into the past behind the API's back, in the database: with the
    # process's credential cache on, that would show only after HAI_AUTH__TOKEN_CACHE_S (a cached
    # entry itself never outlives the expiry it read: tests/unit/test_token_cache.py)
    api.platform.settings.auth.token_cache_s = 0
    r = api.post("/api/v1/tokens", json={"name": "ci", "expires_in_s": 3600})
    assert r.status_code == 201, r.text
    created = r.json()
    expires = datetime.fromisoformat(created["expires_at"])
    assert timedelta(minutes=59) < expires - datetime.now(timezone.utc) <= timedelta(hours=1)
    assert api.get("/api/v1/me", created["token"]).status_code == 200
    with api.platform.sessions() as s:
        s.execute(update(ApiToken).where(ApiToken.id == created["id"])
                  .values(expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))
        s.commit()
    r = api.get("/api/v1/me", created["token"])
    assert r.status_code == 401 and r.json()["detail"] == "token expired"


def test_a_token_without_expiry_never_expires(api):
    created = api.post("/api/v1/tokens", json={"name": "forever"}).json()
    assert created["expires_at"] is None
    assert api.get("/api/v1/me", created["token"]).status_code == 200


def test_a_log_line_over_the_limit_is_cut_with_a_visible_marker(api):
    """HAI_LIMITS__MAX_LOG_LINE_CHARS (100 here): an agent's line of 250 characters is stored as
    its first 100 and a marker saying how much was cut; lines within the limit are untouched."""
    from hai.protocol import LogBatch, LogLine

    api.register_node("n0")
    job = api.submit(**BODY)
    long, short, exact = "a" * 150 + "b" * 100, "short line", "c" * 100
    lines = [LogLine(job_id=job["id"], attempt=1, rank=0, seq=i, ts=float(i), line=text)
             for i, text in enumerate((long, short, exact))]
    r = api.client.post("/api/v1/agent/logs", json=LogBatch(node="n0", lines=lines).model_dump(mode="json"),
                        headers=api.h(api.agent))
    assert r.status_code == 200 and r.json() == {"accepted": 3}, r.text
    got = api.get(f"/api/v1/jobs/{job['id']}/logs").text.splitlines()
    assert got == [
        "[rank 0] " + "a" * 100 + " [hai: line truncated, 150 more characters]",
        "[rank 0] short line",
        "[rank 0] " + exact,
    ]
    assert "b" not in got[0]


def test_a_followed_log_ends_after_the_follow_limit(tmp_path):
    """HAI_LIMITS__MAX_FOLLOW_S: a stream on a job that never ends is closed with a `limit` event
    instead of being held open for ever (default 0: until the job ends)."""
    from fastapi.testclient import TestClient

    from hai.db.models import Base
    from hai.main import create_app
    from hai.services.context import Platform
    from tests.conftest import Api

    s = Settings(data_dir=tmp_path / "hai", frontend_dist=tmp_path / "none", limits=LimitsSettings(max_follow_s=0.5))
    p = Platform.from_settings(s)
    Base.metadata.create_all(p.engine)
    try:
        with TestClient(create_app(p)) as client:
            api = Api(client, p)
            api.register_node("n0")
            job = api.submit(**BODY)  # queued: it would stream for ever
            with client.stream("GET", f"/api/v1/jobs/{job['id']}/logs", params={"follow": "true"},
                               headers=api.h(api.alice)) as resp:
                assert resp.status_code == 200
                events = [ln for ln in resp.iter_lines() if ln.startswith("event:")]
            assert events == ["event: limit"]
    finally:
        p.close()
