from __future__ import annotations


def test_healthz_needs_no_token(api):
    r = api.client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "database": "sqlite"}


def test_openapi_and_docs_need_no_token(api):
    assert api.client.get("/openapi.json").status_code == 200
    assert api.client.get("/docs").status_code == 200


def test_missing_token_is_401(api):
    r = api.client.get("/api/v1/jobs")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"


def test_bad_token_is_401(api):
    assert api.client.get("/api/v1/me", headers=api.h("hai_not-a-token")).status_code == 401


def test_me_reports_user_group_and_admin_flag(api):
    assert api.get("/api/v1/me").json() == {"name": "alice", "group": "vision", "is_admin": False}
    assert api.get("/api/v1/me", api.admin).json() == {"name": "root", "group": "ops", "is_admin": True}


def test_agent_credential_cannot_act_as_user(api):
    r = api.client.get("/api/v1/jobs", headers=api.h(api.agent))
    assert r.status_code == 403
    r = api.client.post("/api/v1/jobs", json={"name": "x", "command": ["true"]}, headers=api.h(api.agent))
    assert r.status_code == 403


def test_user_token_cannot_act_as_agent(api):
    r = api.post("/api/v1/agent/heartbeat", json={"node": "n1"})
    assert r.status_code == 403


def test_personal_token_lifecycle(api):
    r = api.post("/api/v1/tokens", json={"name": "ci"})
    assert r.status_code == 201
    created = r.json()
    secret = created["token"]
    assert secret.startswith("hai_") and created["prefix"] == secret[:12]
    # the new token works, and listing never shows secrets
    assert api.get("/api/v1/me", secret).json()["name"] == "alice"
    listed = api.get("/api/v1/tokens").json()
    assert {t["name"] for t in listed} == {"initial", "ci"}
    assert all("token" not in t for t in listed)
    # the server stores only a hash
    from hai.db.models import ApiToken
    from sqlalchemy import select

    with api.platform.sessions() as s:
        hashes = list(s.scalars(select(ApiToken.token_hash)))
    assert secret not in hashes
    # revoke: the token stops working
    r = api.client.delete(f"/api/v1/tokens/{created['id']}", headers=api.h(api.alice))
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    assert api.get("/api/v1/me", secret).status_code == 401


def test_revoking_someone_elses_token_is_403_and_unknown_is_404(api):
    created = api.post("/api/v1/tokens", json={"name": "ci"}).json()
    r = api.client.delete(f"/api/v1/tokens/{created['id']}", headers=api.h(api.bob))
    assert r.status_code == 403
    assert api.get("/api/v1/me", created["token"]).status_code == 200
    assert api.client.delete("/api/v1/tokens/9999", headers=api.h(api.alice)).status_code == 404


def test_token_create_validates_name(api):
    r = api.post("/api/v1/tokens", json={"name": ""})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "name"]


def test_quotas_are_set_by_admins_and_shown_to_users(api):
    body = {"items": [{"group": "vision", "priority": "HIGH", "gpus": 64}, {"group": "nlp", "priority": "LOW", "user": "bob", "gpus": 8}]}
    assert api.client.put("/api/v1/quotas", json=body, headers=api.h(api.alice)).status_code == 403
    r = api.client.put("/api/v1/quotas", json=body, headers=api.h(api.admin))
    assert r.status_code == 200
    shown = api.get("/api/v1/quotas").json()["items"]
    assert {(q["group"], q["priority"], q["user"], q["gpus"]) for q in shown} == {
        ("vision", "HIGH", None, 64),
        ("nlp", "LOW", "bob", 8),
    }


def test_invalid_quotas_are_refused_and_change_nothing(api):
    good = {"items": [{"group": "vision", "priority": "HIGH", "gpus": 64}]}
    assert api.client.put("/api/v1/quotas", json=good, headers=api.h(api.admin)).status_code == 200
    for bad, field in (
        ({"items": [{"group": "vision", "priority": "HIGH", "gpus": -1}]}, "gpus"),
        ({"items": [{"group": "vision", "priority": "URGENT", "gpus": 1}]}, "priority"),
    ):
        r = api.client.put("/api/v1/quotas", json=bad, headers=api.h(api.admin))
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"][-1] == field
    dup = {"items": [{"group": "g", "priority": "LOW", "gpus": 1}, {"group": "g", "priority": "LOW", "gpus": 2}]}
    r = api.client.put("/api/v1/quotas", json=dup, headers=api.h(api.admin))
    assert r.status_code == 422
    assert api.get("/api/v1/quotas").json()["items"] == [{"group": "vision", "priority": "HIGH", "user": None, "gpus": 64}]


def test_a_token_records_its_last_use_at_most_once_a_minute(api):
    from datetime import datetime, timedelta

    from hai.services.auth import TOKEN_TOUCH_S

    first = api.get("/api/v1/tokens").json()
    used = datetime.fromisoformat(first[0]["last_used_at"])  # this very request used it
    assert datetime.now(used.tzinfo) - used < timedelta(minutes=5)
    again = api.get("/api/v1/tokens").json()
    assert again[0]["last_used_at"] == first[0]["last_used_at"]  # within TOKEN_TOUCH_S: not rewritten
    assert TOKEN_TOUCH_S >= 1
