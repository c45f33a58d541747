"""POST /api/v1/jobs answered before routing (issue 12, ``EarlySubmissions``): for a cached user
credential, a valid body and a valid or no Idempotency-Key it does the route's work and gives the
route's answer (the same status, headers and body, the same replays and refusals, nothing written
on a refusal); everything else reaches the route as it was sent. The route's answer to compare
with is had by forgetting the process's cached credentials (an uncached credential is the
route's)."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from hai.api.jobs import EarlySubmissions
from hai.db.models import IdempotencyKey, Job, JobEvent
from hai.settings import LimitsSettings, Settings

BODY = {"name": "ci", "command": ["python", "train.py", "--lr", "3e-4"], "gpus_per_node": 2,
        "env": {"SEED": "7"}, "tags": ["sweep"], "priority": "HIGH", "max_runtime_s": 3600}
VOLATILE = ("id", "created_at")


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "hai", frontend_dist=tmp_path / "no-dashboard",
                    limits=LimitsSettings(max_queued_jobs_per_user=3))


def _early(api) -> EarlySubmissions:
    layer = api.client.app.middleware_stack
    while layer is not None and not isinstance(layer, EarlySubmissions):
        layer = getattr(layer, "app", None)
    assert layer is not None, "EarlySubmissions is not in the app's middleware"
    return layer


def _rows(api) -> tuple[int, int, int]:
    with api.platform.sessions() as s:
        return (s.scalar(select(func.count(Job.id))), s.scalar(select(func.count(JobEvent.id))),
                s.scalar(select(func.count(IdempotencyKey.id))))


def _forget_credentials(api) -> None:
    """The next request's credential is looked up by the route (and cached again)."""
    api.client.app.state.token_cache = None


def _post(api, body, *, token=None, key=None, **headers):
    h = api.h(token or api.alice) | headers | ({"Idempotency-Key": key} if key else {})
    return api.client.post("/api/v1/jobs", json=body, headers=h)


def _stable(job: dict) -> dict:
    out = {k: v for k, v in job.items() if k not in VOLATILE}
    out["events"] = [{k: v for k, v in e.items() if k not in ("id", "at")} for e in job["events"]]
    return out


def test_a_cached_users_submission_is_answered_early_as_the_route_answers_it(api):
    api.register_node("n0")
    early = _early(api)
    first = _post(api, BODY)  # the credential is not cached yet: the route looks it up (and caches it)
    assert first.status_code == 201, first.text
    assert early.answered == 0
    fast = _post(api, BODY)
    assert fast.status_code == 201, fast.text
    assert early.answered == 1
    _forget_credentials(api)
    routed = _post(api, BODY)
    assert routed.status_code == 201, routed.text
    assert early.answered == 1
    assert fast.headers["content-type"] == routed.headers["content-type"] == "application/json"
    assert int(fast.headers["content-length"]) == len(fast.content)
    # the same document, field for field and in the same order, as the route's response model makes
    assert list(fast.json()) == list(routed.json())
    assert _stable(fast.json()) == _stable(routed.json()) == _stable(first.json())
    job = fast.json()
    assert job["state"] == "queued" and job["user"] == "alice" and job["priority"] == "HIGH"
    assert job["command"] == BODY["command"] and job["env"] == BODY["env"] and job["tags"] == ["sweep"]
    assert [e["to_state"] for e in job["events"]] == ["queued"]
    # written: the job and its event, as the route writes them
    stored = api.get(f"/api/v1/jobs/{job['id']}").json()
    assert _stable(stored) == _stable(job) and stored["id"] == job["id"]
    assert _rows(api) == (3, 3, 0)


def test_refusals_are_the_routes_and_write_nothing(api):
    api.register_node("n0", gpus=8)
    early = _early(api)
    assert _post(api, BODY).status_code == 201  # caches alice's credential
    answered = early.answered

    too_big = _post(api, BODY | {"gpus_per_node": 8, "nodes": 2})  # no placement can ever fit
    _forget_credentials(api)
    too_big_routed = _post(api, BODY | {"gpus_per_node": 8, "nodes": 2})
    assert too_big.status_code == too_big_routed.status_code == 422, too_big.text
    assert too_big.json() == too_big_routed.json()
    assert too_big.json()["detail"][0]["loc"][:2] == ["body", "nodes"]
    assert early.answered == answered + 1  # answered early, with the application's own error
    assert _rows(api) == (1, 1, 0)

    for _ in range(2):
        assert _post(api, BODY).status_code == 201
    full = _post(api, BODY)  # the user's limit of 3 queued jobs
    _forget_credentials(api)
    full_routed = _post(api, BODY)
    assert full.status_code == full_routed.status_code == 429, full.text
    assert full.json() == full_routed.json()
    assert "3 queued job(s)" in full.json()["detail"]
    assert early.answered == answered + 4
    assert _rows(api) == (3, 3, 0)


@pytest.mark.parametrize(
    ("body", "field"),
    [({"command": ["true"]}, "name"), (BODY | {"gpus_per_node": "many"}, "gpus_per_node"),
     (BODY | {"priority": "URGENT"}, "priority"), ([1, 2], None)],
)
def test_a_body_that_is_not_a_job_reaches_the_routes_422(api, body, field):
    api.register_node("n0")
    early = _early(api)
    assert _post(api, BODY).status_code == 201
    answered = early.answered
    r = _post(api, body)
    assert r.status_code == 422, r.text
    assert early.answered == answered
    if field is not None:
        assert r.json()["detail"][0]["loc"] == ["body", field]
    assert _rows(api) == (1, 1, 0)


def test_what_is_not_a_cached_users_json_submission_reaches_the_route(api):
    api.register_node("n0")
    early = _early(api)
    assert _post(api, BODY).status_code == 201
    api.get("/api/v1/me", api.agent)  # the agent's credential cached too (the route refuses it below)
    answered = early.answered
    agent = _post(api, BODY, token=api.agent)
    assert agent.status_code == 403, agent.text
    unknown = _post(api, BODY, token="hai_unknown")
    assert unknown.status_code == 401, unknown.text
    text = api.client.post("/api/v1/jobs", content=b'{"name": "x", "command": ["true"]}',
                           headers=api.h(api.alice) | {"Content-Type": "text/plain"})
    assert text.status_code == 422, text.text
    assert early.answered == answered
    assert _rows(api) == (1, 1, 0)


def test_keys_are_answered_early_as_the_route_answers_them(api):
    """``hai submit`` sends an Idempotency-Key with every job: its first use, a replay (200, the
    same job) and its reuse with another body (422 on the header), early and through the route."""
    api.register_node("n0")
    early = _early(api)
    assert _post(api, BODY).status_code == 201  # caches alice's credential
    answered = early.answered
    first = _post(api, BODY, key="ci-run-7")
    assert first.status_code == 201, first.text
    replay = _post(api, BODY | {"nodes": 1}, key="ci-run-7")  # the same request, a default written out
    assert replay.status_code == 200, replay.text
    assert replay.content == first.content  # the same job, the same bytes
    other = _post(api, BODY | {"name": "other"}, key="ci-run-7")
    assert other.status_code == 422, other.text
    assert early.answered == answered + 3
    _forget_credentials(api)
    routed_replay = _post(api, BODY, key="ci-run-7")
    _forget_credentials(api)
    routed_other = _post(api, BODY | {"name": "other"}, key="ci-run-7")
    assert early.answered == answered + 3
    assert routed_replay.status_code == 200 and routed_replay.content == replay.content
    assert routed_other.status_code == 422 and routed_other.json() == other.json()
    assert other.json()["detail"][0]["loc"][-1] == "Idempotency-Key"
    assert _rows(api) == (2, 2, 1)
    # another user's same key is another job
    bob = _post(api, BODY, token=api.bob, key="ci-run-7")
    bob_again = _post(api, BODY, token=api.bob, key="ci-run-7")
    assert (bob.status_code, bob_again.status_code) == (201, 200)
    assert bob.json()["id"] == bob_again.json()["id"] != first.json()["id"] and bob.json()["user"] == "bob"
    assert early.answered == answered + 4  # bob's first request looked his credential up
    assert _rows(api) == (3, 3, 2)


@pytest.mark.parametrize("key", ["has space", "x" * 256, "", "caf\u00e9"], ids=["space", "too-long", "empty", "latin-1"])
def test_a_key_the_routes_rules_refuse_reaches_the_routes_422(api, key):
    api.register_node("n0")
    early = _early(api)
    assert _post(api, BODY).status_code == 201
    answered = early.answered
    r = api.client.post("/api/v1/jobs", json=BODY,
                        headers=[("Authorization", f"Bearer {api.alice}"), ("Idempotency-Key", key.encode("latin-1"))])
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
    assert early.answered == answered
    assert _rows(api) == (1, 1, 0)


def test_two_keys_reach_the_route(api):
    api.register_node("n0")
    early = _early(api)
    assert _post(api, BODY).status_code == 201
    answered = early.answered
    api.client.post("/api/v1/jobs", json=BODY, headers=[("Authorization", f"Bearer {api.alice}"),
                                                         ("Idempotency-Key", "a"), ("Idempotency-Key", "b")])
    assert early.answered == answered
