"""POST /api/v1/jobs honours Idempotency-Key (issue 13): same key and body -> the same job
(201 first, 200 on replay), never a second job; another body with the key -> 422; per user."""

from __future__ import annotations

from sqlalchemy import func, select

from hai.db.models import IdempotencyKey, Job

BODY = {"name": "ci", "command": ["echo", "hi"], "gpus_per_node": 1}


def _counts(api) -> tuple[int, int]:
    with api.platform.sessions() as s:
        return s.scalar(select(func.count(Job.id))), s.scalar(select(func.count(IdempotencyKey.id)))


def _post(api, body, key, token=None):
    headers = api.h(token or api.alice) | {"Idempotency-Key": key}
    return api.client.post("/api/v1/jobs", json=body, headers=headers)


def test_same_key_same_body_returns_the_same_job(api):
    api.register_node("n0")
    first = _post(api, BODY, "k-1")
    assert first.status_code == 201, first.text
    again = _post(api, BODY, "k-1")
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert _counts(api) == (1, 1)


def test_replay_matches_the_normalised_body(api):
    """Defaults written out or left out are the same request."""
    api.register_node("n0")
    first = _post(api, BODY, "k-n")
    again = _post(api, BODY | {"nodes": 1, "priority": "NORMAL", "env": {}}, "k-n")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]


def test_same_key_other_body_is_422_and_writes_nothing(api):
    api.register_node("n0")
    assert _post(api, BODY, "k-2").status_code == 201
    r = _post(api, BODY | {"name": "other"}, "k-2")
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"][-1] == "Idempotency-Key" and "another request body" in detail["msg"]
    assert _counts(api) == (1, 1)


def test_keys_are_per_user(api):
    api.register_node("n0")
    a = _post(api, BODY, "shared", api.alice)
    b = _post(api, BODY, "shared", api.bob)
    assert (a.status_code, b.status_code) == (201, 201)
    assert a.json()["id"] != b.json()["id"]
    assert b.json()["user"] == "bob"
    assert _counts(api) == (2, 2)


def test_without_a_key_each_post_is_a_new_job(api):
    api.register_node("n0")
    api.submit(**BODY)
    api.submit(**BODY)
    assert _counts(api) == (2, 0)


def test_bad_keys_are_422_on_the_header(api):
    api.register_node("n0")
    for key in ("x" * 256, "has space"):
        r = _post(api, BODY, key)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
    assert _counts(api) == (0, 0)


def test_a_refused_first_request_does_not_bind_the_key(api):
    """A submission refused (no node fits) stores no key: the fixed request then succeeds."""
    api.register_node("n0", gpus=4)
    r = _post(api, BODY | {"gpus_per_node": 8}, "k-3")
    assert r.status_code == 422
    assert _counts(api) == (0, 0)
    assert _post(api, BODY, "k-3").status_code == 201
