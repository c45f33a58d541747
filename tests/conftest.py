"""Shared fixtures. Real SQLite files per test; PostgreSQL and Redis for integration tests
come from HAI_TEST_DATABASE_URL / HAI_TEST_REDIS_URL (set by `make test`)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hai.db.models import Base
from hai.main import create_app
from hai.protocol import AgentHello, GpuInfo
from hai.services import auth
from hai.services.context import Platform
from hai.settings import Settings

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@contextmanager
def uvicorn_thread(app, **config) -> Iterator[str]:  # noqa: ANN001, ANN003
    """``app`` served by a real uvicorn server in a thread on a free port of 127.0.0.1 (its
    own logging, HTTP/1.1, keep-alive: what ``TestClient`` leaves out), with the platform's HTTP
    protocol unless ``http`` says otherwise; yields its URL once it listens and stops it
    afterwards."""
    import uvicorn

    from hai.agent.testing import wait_for
    from hai.api.http_protocol import HTTP_PROTOCOL

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config.setdefault("http", HTTP_PROTOCOL)  # what ``hai server`` and ``hai dev`` serve with
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=20, what="uvicorn to listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "hai", frontend_dist=tmp_path / "no-dashboard")


@pytest.fixture
def platform(settings: Settings):
    p = Platform.from_settings(settings)
    Base.metadata.create_all(p.engine)
    yield p
    p.close()


class Api:
    """A TestClient plus the tokens a test needs."""

    def __init__(self, client: TestClient, platform: Platform):
        self.client = client
        self.platform = platform
        with platform.sessions() as s:
            _, self.admin = auth.create_user(session=s, name="root", group="ops", is_admin=True)
            _, self.alice = auth.create_user(session=s, name="alice", group="vision")
            _, self.bob = auth.create_user(session=s, name="bob", group="nlp")
            self.agent = auth.create_agent_token(session=s)

    def h(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    def register_node(self, name: str, *, zone: str = "A", leaf: str = "A1", gpus: int = 8) -> dict:
        hello = AgentHello(
            node=name, zone=zone, leaf=leaf, address="127.0.0.1", fake_gpus=True,
            gpus=[GpuInfo(index=i, uuid=f"GPU-{name}-{i}", model="Fake", memory_total_mib=81920) for i in range(gpus)],
        )
        r = self.client.post("/api/v1/agent/register", json=hello.model_dump(mode="json"), headers=self.h(self.agent))
        assert r.status_code == 200, r.text
        return r.json()

    def submit(self, token: str | None = None, **body) -> dict:
        body.setdefault("name", "job")
        body.setdefault("command", ["echo", "hi"])
        r = self.client.post("/api/v1/jobs", json=body, headers=self.h(token or self.alice))
        assert r.status_code == 201, r.text
        return r.json()

    def get(self, path: str, token: str | None = None, **kw):
        return self.client.get(path, headers=self.h(token or self.alice), **kw)

    def post(self, path: str, token: str | None = None, **kw):
        return self.client.post(path, headers=self.h(token or self.alice), **kw)


@pytest.fixture
def api(platform: Platform):
    app = create_app(platform)
    with TestClient(app) as client:
        yield Api(client, platform)


@contextmanager
def api_with_two_nodes(url: str, tmp_path: Path, *, create_all: bool = False, **settings) -> Iterator[Api]:  # noqa: ANN003
    """An Api (users alice and bob, two 8-GPU nodes registered by their agents) on the database
    at ``url``, its schema built by the migrations or, with ``create_all``, as the ``platform``
    fixture builds it (the models' own copy of any trigger DDL); ``settings``: more of Settings."""
    from sqlalchemy import create_engine

    from hai.db.migrate import upgrade

    if create_all:
        engine = create_engine(url)
        Base.metadata.create_all(engine)
        engine.dispose()
    else:
        upgrade(url)
    platform = Platform.from_settings(Settings(data_dir=tmp_path / "hai", frontend_dist=tmp_path / "none",
                                               db={"url": url}, **settings))
    try:
        with TestClient(create_app(platform)) as client:
            a = Api(client, platform)
            a.register_node("n0")
            a.register_node("n1")
            yield a
    finally:
        platform.close()


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    for item in items:
        path = str(item.fspath)
        if "/integration/" in path:
            item.add_marker(pytest.mark.integration)
        if "/e2e/" in path:
            item.add_marker(pytest.mark.e2e)


def env_url(name: str) -> str | None:
    return os.environ.get(name) or None
