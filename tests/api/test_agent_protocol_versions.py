"""Issue 12: protocol versions are negotiated. A 426 names the versions the server speaks
(``X-HAI-Agent-Protocols``); the agent's client goes on in the newest one it speaks too (an
agent of version 2 with a server of version 1 during a rolling upgrade) and gives up, saying why,
when there is none. A real uvicorn server in a thread and the agent's own client."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import select

from hai.agent.client import AgentClient, ProtocolVersionUnsupported
from hai.db.base import Base
from hai.db.models import Node, ValidationRun
from hai.main import create_app
from hai.protocol import PROTOCOL_VERSION, PROTOCOLS_HEADER, AgentHello, GpuInfo, Heartbeat, ValidationReport
from hai.services import agents as agent_service
from hai.services import auth
from hai.services.context import Platform
from hai.settings import Settings
from tests.conftest import uvicorn_thread


@pytest.fixture
def served(tmp_path):
    platform = Platform.from_settings(Settings(data_dir=tmp_path, frontend_dist=tmp_path / "none",
                                               validation={"quick_every_heartbeats": 2}))
    Base.metadata.create_all(platform.engine)
    with platform.sessions() as s:
        token = auth.create_agent_token(session=s)
    with uvicorn_thread(create_app(platform), log_level="warning") as url:
        yield platform, url, token
    platform.close()


def hello(name: str) -> AgentHello:
    return AgentHello(node=name, address="127.0.0.1", fake_gpus=True,
                      gpus=[GpuInfo(index=0, uuid=f"GPU-{name}", model="Fake", memory_total_mib=1)])


def stored(platform: Platform, name: str) -> tuple[int | None, list[str]]:
    with platform.sessions() as s:
        version = s.scalar(select(Node.protocol_version).where(Node.name == name))
        runs = list(s.scalars(select(ValidationRun.requested_by).where(ValidationRun.node_name == name)))
    return version, runs


def test_an_agent_speaks_the_newest_version_with_a_server_of_this_release(served):
    platform, url, token = served
    client = AgentClient(url, token)
    client.register(hello("new"))
    replies = [client.heartbeat(Heartbeat(node="new")) for _ in range(4)]
    assert client.version == PROTOCOL_VERSION == 2
    assert {r.quick_every_heartbeats for r in replies} == {2}  # the agent runs its rounds itself
    assert all(not r.validations for r in replies)
    assert stored(platform, "new") == (2, [])


def test_an_agent_goes_on_in_version_1_with_a_server_that_speaks_only_that(served, monkeypatch):
    platform, url, token = served
    monkeypatch.setattr(agent_service, "SUPPORTED_VERSIONS", frozenset({1}))  # a server not upgraded yet
    r = httpx.post(f"{url}/api/v1/agent/register",
                   headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                   content=hello("old").model_dump_json())
    assert r.status_code == 426 and r.headers[PROTOCOLS_HEADER] == "1" and "speaks [1]" in r.text
    client = AgentClient(url, token)
    client.register(hello("old"))
    assert client.version == 1
    replies = [client.heartbeat(Heartbeat(node="old")) for _ in range(3)]
    assert {r.quick_every_heartbeats for r in replies} == {0}
    # version 1's rounds: the server asks for one in a reply (the node's first after its phase)
    while not replies[-1].validations:
        assert len(replies) < 10
        replies.append(client.heartbeat(Heartbeat(node="old")))
    assert replies[-1].validations[0].level == "quick"
    # a round the agent ran on its own (before it failed over to this server) is not sent to it
    own = ValidationReport(run_id=None, level="quick", started_at=1.0, finished_at=2.0)
    client.heartbeat(Heartbeat(node="old", validations=[own]))
    assert stored(platform, "old") == (1, ["validator"])


def test_an_agent_that_shares_no_version_with_the_server_says_so(served, monkeypatch):
    platform, url, token = served
    monkeypatch.setattr(agent_service, "SUPPORTED_VERSIONS", frozenset({7}))
    client = AgentClient(url, token)
    with pytest.raises(ProtocolVersionUnsupported, match="does not support agent protocol version 2"):
        client.register(hello("future"))
    assert client.version == 2
    assert stored(platform, "future") == (None, [])
