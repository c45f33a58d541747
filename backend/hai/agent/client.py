"""HTTP client of the agent protocol (httpx). One instance per thread."""

from __future__ import annotations

import logging

import httpx
from pydantic import BaseModel

from hai.protocol import (AGENT_ROUNDS_VERSION, PROTOCOL_VERSION, PROTOCOLS_HEADER, SUPPORTED_VERSIONS, AgentHello, Heartbeat, LogAck,
                          LogBatch, ServerReply)

log = logging.getLogger("hai.agent")

API = "/api/v1/agent"


class AgentError(Exception):
    pass


class ServerUnavailable(AgentError):
    """Connection failed, timed out, or the server answered 5xx: retry with backoff."""


class ProtocolVersionUnsupported(AgentError):
    """HTTP 426: the server does not speak this agent's protocol version."""


class Rejected(AgentError):
    """4xx other than 426 (bad token, invalid message): logged, retried with backoff."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


def common_version(header: str | None) -> int | None:
    """The newest version this agent speaks among those a 426's header lists (None: none)."""
    try:
        theirs = {int(v) for v in (header or "").split(",") if v.strip()}
    except ValueError:
        return None
    both = theirs & SUPPORTED_VERSIONS
    return max(both) if both else None


def server_urls(server: str) -> list[str]:
    """``--server`` is one URL or several, comma-separated (API servers behind no load balancer)."""
    urls = [s.strip().rstrip("/") for s in server.split(",") if s.strip()]
    if not urls:
        raise ValueError("no server URL given")
    return urls


class AgentClient:
    """Talks to the first server of ``server`` (a URL, or several comma-separated); when that one
    is unreachable or answers 5xx, the next request goes to the next one (issue 13: an API
    server killed or restarting does not silence its agents until it is back)."""

    def __init__(self, server: str, token: str, *, timeout_s: float = 15.0):
        self.servers = server_urls(server)
        self._i = 0
        self._https = [
            httpx.Client(
                base_url=url,
                headers={"Authorization": f"Bearer {token}", "User-Agent": f"hai-agent/{PROTOCOL_VERSION}"},
                timeout=httpx.Timeout(timeout_s, connect=5.0),
            )
            for url in self.servers
        ]
        self.timeout_s = timeout_s
        # the version this client speaks: the newest, until a server answers 426 listing an older
        # one that this agent speaks too (a server not upgraded yet, issue 12); kept from then on
        self.version = PROTOCOL_VERSION

    @property
    def server(self) -> str:
        return self.servers[self._i]

    @property
    def _http(self) -> httpx.Client:
        return self._https[self._i]

    def _next(self) -> None:
        self._i = (self._i + 1) % len(self.servers)

    def _post(self, path: str, msg: BaseModel, *, timeout: float | None = None) -> httpx.Response:
        http = self._http
        version = self.version
        if msg.protocol_version != version:  # type: ignore[attr-defined]
            update: dict = {"protocol_version": version}
            if version < AGENT_ROUNDS_VERSION and getattr(msg, "validations", None):
                # a server of version 1 knows no own rounds (it asks for each): none is sent to it
                # (one the agent ran before it failed over to such a server is dropped)
                update["validations"] = [r for r in msg.validations if r.run_id is not None]  # type: ignore[attr-defined]
            msg = msg.model_copy(update=update)
        try:
            r = http.post(f"{API}/{path}", content=msg.model_dump_json(), headers={"Content-Type": "application/json"},
                          timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
        except httpx.HTTPError as e:
            self._next()
            raise ServerUnavailable(f"{type(e).__name__}: {e}") from e
        if r.status_code == 426:
            other = common_version(r.headers.get(PROTOCOLS_HEADER))
            if other is not None and other != version:
                log.warning("the server at %s speaks agent protocol versions %s: speaking %d with it",
                            self.server, r.headers.get(PROTOCOLS_HEADER), other)
                self.version = other
                return self._post(path, msg, timeout=timeout)
            raise ProtocolVersionUnsupported(
                f"the server at {self.server} does not support agent protocol version {version}: "
                f"{r.text[:300]} — upgrade the agent (or the server)")
        if r.status_code >= 500:
            self._next()
            raise ServerUnavailable(f"HTTP {r.status_code}: {r.text[:300]}")
        if r.status_code >= 400:
            raise Rejected(r.status_code, r.text)
        return r

    def register(self, hello: AgentHello) -> ServerReply:
        r = self._post("register", hello)
        return ServerReply.model_validate_json(r.content)

    def heartbeat(self, hb: Heartbeat) -> ServerReply:
        # a long poll may be held up to wait_s by the server
        r = self._post("heartbeat", hb, timeout=self.timeout_s + hb.wait_s)
        return ServerReply.model_validate_json(r.content)

    def logs(self, batch: LogBatch) -> LogAck:
        r = self._post("logs", batch)
        return LogAck.model_validate_json(r.content)

    def close(self) -> None:
        for http in self._https:
            http.close()
