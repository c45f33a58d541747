"""Issue 12: each API process checks a credential once per ``HAI_AUTH__TOKEN_CACHE_S`` instead of
once per request; a revocation made through another process reaches every process's cache
through Redis at once (issue 13: a revoked token must stop working). PostgreSQL + Redis, two
platforms standing for two API replicas."""

from __future__ import annotations


import pytest
from fastapi.testclient import TestClient

from hai.main import create_app
from hai.services import auth, notify
from tests.integration.conftest import pg_url, redis_url, replicas, server_db_url  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration


@pytest.fixture
def two(replicas):  # noqa: ANN001, ANN201
    return replicas(2, auth={"token_cache_s": 3600})  # only a revocation ends an entry


def test_a_token_revoked_on_one_replica_is_refused_by_the_other_at_once(two) -> None:
    one, other = two
    with one.sessions() as s:
        _, secret = auth.create_user(session=s, name="alice", group="g")
    h = {"Authorization": f"Bearer {secret}"}
    with TestClient(create_app(one)) as c1, TestClient(create_app(other)) as c2:
        made = c1.post("/api/v1/tokens", json={"name": "ci"}, headers=h).json()
        ci = {"Authorization": f"Bearer {made['token']}"}
        assert c1.get("/api/v1/me", headers=ci).status_code == 200  # looked up once ...
        queries = []
        from sqlalchemy import event

        event.listen(one.engine, "before_cursor_execute", lambda *a: queries.append(a[2]))
        assert c1.get("/api/v1/me", headers=ci).status_code == 200  # ... then answered from the cache
        assert not any("api_tokens" in q for q in queries), queries

        since = one.notifier.version(notify.TOKENS)
        assert c2.delete(f"/api/v1/tokens/{made['id']}", headers=h).status_code == 200
        # the revocation reaches replica 1 through Redis (synchronised on its notifier, no sleep)
        assert one.notifier.wait(notify.TOKENS, since, 30), "the revocation never reached replica 1"
        r = c1.get("/api/v1/me", headers=ci)
        assert r.status_code == 401, r.text
        assert c1.get("/api/v1/me", headers=h).status_code == 200  # other tokens are unaffected
