"""The endpoint x role matrix (issue 13): every route of the app, seven callers each —
anonymous, the job's owner, another user, an admin, the node (agent) credential, a revoked
token and an expired token — with the status each must get, and no change written by any
refused request (every table is read before and after and compared).

A route of the app without a row here fails `test_every_route_has_a_row`, so a new endpoint
cannot ship without its authorisation being stated."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import pytest
from fastapi.routing import iter_route_contexts
from sqlalchemy import select, update
from starlette.routing import Mount, Route

from hai.db.base import utcnow
from hai.db.models import ApiToken, Base
from hai.main import create_app
from hai.protocol import AgentHello, GpuInfo, Heartbeat, LogBatch, LogLine
from hai.settings import LimitsSettings, Settings

ROLES = ("anonymous", "user", "other", "admin", "agent", "revoked", "expired")


def _expect(anonymous=401, user=200, other=200, admin=200, agent=403, revoked=401, expired=401) -> dict[str, int]:
    return dict(anonymous=anonymous, user=user, other=other, admin=admin, agent=agent, revoked=revoked, expired=expired)


PUBLIC = dict.fromkeys(ROLES, 200)
ANY_USER = _expect()
OWNER = _expect(other=403)
ADMIN = _expect(user=403, other=403)
AGENT = _expect(user=403, other=403, admin=403, agent=200)


@dataclass
class Row:
    method: str
    path: str
    expect: dict[str, int]
    body: Callable[["World"], dict] | dict | None = None
    setup: Callable[["World"], None] | None = None  # runs before the request, as its owner would
    ok: dict[str, int] = field(default_factory=dict)  # overrides of the expected 2xx per role


def _hb(w: "World") -> dict:
    return Heartbeat(node="n0").model_dump(mode="json")


def _logs(w: "World") -> dict:
    line = LogLine(job_id=w.job_id, attempt=1, rank=0, seq=0, ts=0.0, line="hello")
    return LogBatch(node="n0", lines=[line]).model_dump(mode="json")


def _hello(w: "World") -> dict:
    return w.hello


def _hold(w: "World") -> None:
    r = w.api.post(f"/api/v1/jobs/{w.job_id}/suspend")
    assert r.status_code == 200, r.text


def _drain(w: "World") -> None:
    r = w.api.post("/api/v1/nodes/n0/drain", w.api.admin, json={"reason": "matrix"})
    assert r.status_code == 200, r.text


def _validation(w: "World") -> None:
    r = w.api.post("/api/v1/nodes/n0/validate", w.api.admin, json={"level": "quick"})
    assert r.status_code == 202, r.text
    w.params["run_id"] = r.json()["id"]


JOB = {"name": "m", "command": ["echo", "hi"], "gpus_per_node": 1}
QUOTAS = {"items": [{"group": "vision", "priority": "NORMAL", "user": None, "gpus": 8}]}

ROWS: list[Row] = [
    Row("GET", "/", PUBLIC),
    Row("GET", "/openapi.json", PUBLIC),
    Row("GET", "/docs", PUBLIC),
    Row("GET", "/docs/oauth2-redirect", PUBLIC),
    Row("GET", "/redoc", PUBLIC),
    Row("GET", "/healthz", PUBLIC),
    Row("GET", "/metrics", ANY_USER),
    Row("POST", "/api/v1/jobs", _expect(), body=JOB, ok=dict(user=201, other=201, admin=201)),
    Row("POST", "/api/v1/jobs/batch", _expect(), body={"jobs": [JOB, JOB]}, ok=dict(user=201, other=201, admin=201)),
    Row("GET", "/api/v1/jobs", ANY_USER),
    Row("GET", "/api/v1/jobs/{job_id}", OWNER),
    Row("POST", "/api/v1/jobs/{job_id}/cancel", OWNER),
    Row("POST", "/api/v1/jobs/{job_id}/suspend", OWNER),
    Row("POST", "/api/v1/jobs/{job_id}/resume", OWNER, setup=_hold),
    Row("GET", "/api/v1/jobs/{job_id}/logs", OWNER),
    Row("GET", "/api/v1/jobs/{job_id}/metrics", OWNER),
    Row("GET", "/api/v1/nodes", ANY_USER),
    Row("GET", "/api/v1/nodes/{name}", ANY_USER),
    Row("POST", "/api/v1/nodes/{name}/drain", ADMIN, body={"reason": "matrix"}),
    Row("POST", "/api/v1/nodes/{name}/undrain", ADMIN, body={"force": True}, setup=_drain),
    Row("POST", "/api/v1/nodes/{name}/validate", ADMIN, body={"level": "quick"}, ok=dict(admin=202)),
    Row("GET", "/api/v1/nodes/{name}/validations", ANY_USER),
    Row("GET", "/api/v1/validations/{run_id}", ANY_USER, setup=_validation),
    Row("GET", "/api/v1/nodes/{name}/metrics", ANY_USER),
    Row("GET", "/api/v1/me", ANY_USER),
    Row("GET", "/api/v1/tokens", ANY_USER),
    Row("POST", "/api/v1/tokens", ANY_USER, body={"name": "new"}, ok=dict(user=201, other=201, admin=201)),
    Row("DELETE", "/api/v1/tokens/{token_id}", OWNER),
    Row("GET", "/api/v1/quotas", ANY_USER),
    Row("PUT", "/api/v1/quotas", ADMIN, body=QUOTAS),
    Row("GET", "/api/v1/cluster/summary", ANY_USER),
    Row("GET", "/api/v1/cluster/nodes", ANY_USER),
    Row("GET", "/api/v1/cluster/utilisation", ANY_USER),
    Row("GET", "/api/v1/cluster/idle-allocations", ANY_USER),
    Row("GET", "/api/v1/usage", ANY_USER),
    Row("GET", "/api/v1/usage/quotas", ANY_USER),
    Row("POST", "/api/v1/agent/register", AGENT, body=_hello),
    Row("POST", "/api/v1/agent/heartbeat", AGENT, body=_hb),
    Row("POST", "/api/v1/agent/logs", AGENT, body=_logs),
]


class World:
    """A fresh platform: node n0, a queued job of alice's, a second token of alice's (the one
    DELETE /tokens/{id} revokes), a revoked and an expired token of alice's."""

    def __init__(self, api) -> None:  # noqa: ANN001
        self.api = api
        api.register_node("n0")  # asserts 200
        self.hello = AgentHello(
            node="n0", zone="A", leaf="A1", address="127.0.0.1", fake_gpus=True,
            gpus=[GpuInfo(index=i, uuid=f"GPU-n0-{i}", model="Fake", memory_total_mib=81920) for i in range(8)],
        ).model_dump(mode="json")
        self.job_id = api.submit(**JOB)["id"]
        r = api.post("/api/v1/tokens", json={"name": "spare"})
        assert r.status_code == 201, r.text
        self.params: dict[str, object] = {"job_id": self.job_id, "name": "n0", "token_id": r.json()["id"]}
        revoked = api.post("/api/v1/tokens", json={"name": "revoked"}).json()
        assert api.client.delete(f"/api/v1/tokens/{revoked['id']}", headers=api.h(api.alice)).status_code == 200
        expired = api.post("/api/v1/tokens", json={"name": "expired", "expires_in_s": 3600}).json()
        with api.platform.sessions() as s:
            s.execute(update(ApiToken).where(ApiToken.id == expired["id"]).values(expires_at=utcnow() - timedelta(seconds=1)))
            s.commit()
        self.tokens = {
            "anonymous": None, "user": api.alice, "other": api.bob, "admin": api.admin, "agent": api.agent,
            "revoked": revoked["token"], "expired": expired["token"],
        }

    # bookkeeping any authenticated request may touch (a token's last use, at most once a
    # minute): not a change the request made
    BOOKKEEPING = {("api_tokens", "last_used_at")}

    def snapshot(self) -> dict[str, list[tuple]]:
        with self.api.platform.sessions() as s:
            out = {}
            for t in Base.metadata.sorted_tables:
                cols = [c for c in t.columns if (t.name, c.name) not in self.BOOKKEEPING]
                out[t.name] = sorted(map(tuple, s.execute(select(*cols)).all()), key=repr)
            return out

    def call(self, row: Row, role: str):
        body = row.body(self) if callable(row.body) else row.body
        token = self.tokens[role]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        path = row.path.format(**self.params)
        return self.api.client.request(row.method, path, json=body, headers=headers)


@pytest.fixture
def settings(tmp_path) -> Settings:
    # the failed-authentication limit is tested in test_limits_api; here it must not interfere
    return Settings(data_dir=tmp_path / "hai", frontend_dist=tmp_path / "no-dashboard",
                    limits=LimitsSettings(auth_failures=10_000))


def _app_routes(app) -> set[tuple[str, str]]:  # noqa: ANN001
    """(method, path) of every route, those of included routers too (FastAPI's iter_route_contexts
    walks them); a mounted app (the dashboard) is ("MOUNT", path)."""
    found = set()
    for ctx in iter_route_contexts(app.routes):
        if isinstance(ctx.original_route, Mount):
            found.add(("MOUNT", ctx.original_route.path))
            continue
        assert isinstance(ctx.original_route, Route), f"a route of an unknown kind: {ctx.original_route!r}"
        for method in ctx.methods or ():
            if method != "HEAD":
                found.add((method, re.sub(r"\{(\w+):\w+\}", r"{\1}", ctx.path)))  # {job_id:int} -> {job_id}
    return found


def test_every_route_has_a_row(platform, tmp_path):
    rows = {(r.method, r.path) for r in ROWS}
    assert len(rows) == len(ROWS), "a route is listed twice"
    app = create_app(platform)
    missing = _app_routes(app) - rows
    assert not missing, f"routes without a row in the role matrix: {sorted(missing)}"
    stale = rows - _app_routes(app)
    assert not stale, f"rows for routes the app no longer has: {sorted(stale)}"
    # the production app serves the dashboard at / instead of the no-dashboard page: also covered
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "index.html").write_text("<!doctype html><title>hai</title>")
    platform.settings.frontend_dist = dist
    assert _app_routes(create_app(platform)) - rows == {("MOUNT", "")}


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.method} {r.path}")
def test_role_matrix(api, row: Row):
    """Each role gets its expected status. Refused requests (and every GET) change nothing.
    Allowed changes run last, each on a freshly-set-up target, so they do not mask one another."""
    world = World(api)
    if row.setup is not None:
        row.setup(world)
    expected = row.expect | row.ok
    writes_when_allowed = row.method != "GET"
    order = sorted(ROLES, key=lambda role: (writes_when_allowed and expected[role] < 400, ROLES.index(role)))
    got: dict[str, int] = {}
    for role in order:
        allowed = expected[role] < 400
        if allowed and writes_when_allowed and any(got[r] < 400 for r in got):
            # an earlier allowed change (e.g. alice cancelled the job) would make this one a 409:
            # start again from a fresh target of the same shape
            _refresh(world, row)
        before = world.snapshot()
        r = world.call(row, role)
        got[role] = r.status_code
        if r.status_code >= 400 or row.method == "GET":
            assert world.snapshot() == before, f"{role} {row.method} {row.path} ({r.status_code}) changed the database"
        if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
            assert r.json().get("detail"), f"{role}: a refusal says why"
    assert got == expected, f"{row.method} {row.path}: got {got}"


def _refresh(world: World, row: Row) -> None:
    api = world.api
    if "{job_id}" in row.path:
        world.job_id = api.submit(**JOB)["id"]
        world.params["job_id"] = world.job_id
    if "{token_id}" in row.path:
        world.params["token_id"] = api.post("/api/v1/tokens", json={"name": "spare"}).json()["id"]
    if row.setup is not None:
        row.setup(world)


def test_the_queue_shows_another_users_job_but_not_its_environment(api):
    """A hole the matrix found: GET /jobs/{id} of alice's job is a 403 for bob, yet the listing
    handed him the job's whole environment (where secrets live). Now the values are masked."""
    api.register_node("n0")
    mine = api.submit(**JOB, env={"WANDB_API_KEY": "s3cret"})
    for token, shown in ((api.alice, "s3cret"), (api.admin, "s3cret"), (api.bob, "***")):
        items = {j["id"]: j for j in api.get("/api/v1/jobs", token).json()["items"]}
        assert items[mine["id"]]["env"] == {"WANDB_API_KEY": shown}
    assert "s3cret" not in api.get("/api/v1/jobs", api.bob).text
