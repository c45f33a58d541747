"""HTTP client of the agent protocol (httpx). One instance per thread."""

from __future__ import annotations

import httpx

from hai.protocol import PROTOCOL_VERSION, AgentHello, Heartbeat, LogAck, LogBatch, ServerReply

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

    @property
    def server(self) -> str:
        return self.servers[self._i]

    @property
    def _http(self) -> httpx.Client:
        return self._https[self._i]

    def _next(self) -> None:
        self._i = (self._i + 1) % len(self.servers)

    def _post(self, path: str, body: str, *, timeout: float | None = None) -> httpx.Response:
        http = self._http
        try:
            r = http.post(f"{API}/{path}", content=body, headers={"Content-Type": "application/json"},
                          timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
        except httpx.HTTPError as e:
            self._next()
            raise ServerUnavailable(f"{type(e).__name__}: {e}") from e
        if r.status_code == 426:
            raise ProtocolVersionUnsupported(
                f"the server at {self.server} does not support agent protocol version {PROTOCOL_VERSION}: "
                f"{r.text[:300]} — upgrade the agent (or the server)")
        if r.status_code >= 500:
            self._next()
            raise ServerUnavailable(f"HTTP {r.status_code}: {r.text[:300]}")
        if r.status_code >= 400:
            raise Rejected(r.status_code, r.text)
        return r

    def register(self, hello: AgentHello) -> ServerReply:
        r = self._post("register", hello.model_dump_json())
        return ServerReply.model_validate_json(r.content)

    def heartbeat(self, hb: Heartbeat) -> ServerReply:
        # a long poll may be held up to wait_s by the server
        r = self._post("heartbeat", hb.model_dump_json(), timeout=self.timeout_s + hb.wait_s)
        return ServerReply.model_validate_json(r.content)

    def logs(self, batch: LogBatch) -> LogAck:
        r = self._post("logs", batch.model_dump_json())
        return LogAck.model_validate_json(r.content)

    def close(self) -> None:
        for http in self._https:
            http.close()
