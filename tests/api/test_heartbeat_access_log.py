"""Issue 12: hai server's access log leaves out agent heartbeats answered 2xx (a line per node per
second at 1,250 nodes) and keeps every other line, refused heartbeats included; with
``HAI_AGENT__ACCESS_LOG_HEARTBEATS=true`` it keeps them all. A real uvicorn server in a thread,
so that the lines are uvicorn's own."""

from __future__ import annotations

import logging

import httpx
import pytest

from hai.api.agent import QuietHeartbeats
from hai.db.base import Base
from hai.main import create_app
from hai.protocol import AgentHello, GpuInfo, Heartbeat
from hai.services import auth
from hai.services.context import Platform
from hai.settings import Settings
from tests.conftest import uvicorn_thread


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def access_log():  # noqa: ANN201
    logger = logging.getLogger("uvicorn.access")
    handler, filters = _Lines(), list(logger.filters)
    yield handler
    logger.removeHandler(handler)
    logger.filters[:] = filters


def _serve_and_beat(tmp_path, lines: _Lines, **agent) -> None:  # noqa: ANN001, ANN003
    platform = Platform.from_settings(Settings(data_dir=tmp_path, frontend_dist=tmp_path / "none", agent=agent))
    Base.metadata.create_all(platform.engine)
    with platform.sessions() as s:
        token = auth.create_agent_token(session=s)
    try:
        with uvicorn_thread(create_app(platform), log_level="info") as url, \
                httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
            # uvicorn configured its loggers when it started (dictConfig replaced their handlers)
            logging.getLogger("uvicorn.access").addHandler(lines)
            hello = AgentHello(node="n0", address="127.0.0.1", fake_gpus=True,
                               gpus=[GpuInfo(index=0, uuid="G0", model="Fake", memory_total_mib=1)])
            assert c.post("/api/v1/agent/register", json=hello.model_dump(mode="json")).status_code == 200
            hb = Heartbeat(node="n0").model_dump(mode="json")
            assert c.post("/api/v1/agent/heartbeat", json=hb).status_code == 200
            assert c.post("/api/v1/agent/heartbeat", json=hb | {"protocol_version": 99}).status_code == 426
            assert c.get("/healthz").status_code == 200
    finally:
        platform.close()


def test_heartbeats_answered_2xx_are_left_out_of_the_access_log(tmp_path, access_log):  # noqa: ANN001
    _serve_and_beat(tmp_path, access_log)
    lines = access_log.lines
    assert any('"POST /api/v1/agent/register HTTP/1.1" 200' in line for line in lines), lines
    assert any('"GET /healthz HTTP/1.1" 200' in line for line in lines), lines
    assert any('"POST /api/v1/agent/heartbeat HTTP/1.1" 426' in line for line in lines), lines
    assert not any('"POST /api/v1/agent/heartbeat HTTP/1.1" 200' in line for line in lines), lines
    first = logging.getLogger("uvicorn.access").filters[0]
    assert isinstance(first, QuietHeartbeats)  # before the token redaction: dropped lines skip it


def test_the_setting_keeps_every_heartbeat_in_the_access_log(tmp_path, access_log):  # noqa: ANN001
    _serve_and_beat(tmp_path, access_log, access_log_heartbeats=True)
    assert any('"POST /api/v1/agent/heartbeat HTTP/1.1" 200' in line for line in access_log.lines), access_log.lines
    assert not any(isinstance(f, QuietHeartbeats) for f in logging.getLogger("uvicorn.access").filters)
