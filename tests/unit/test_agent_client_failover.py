"""The agent's client with several API servers (issue 13): when one is down (connection
refused) or answers 5xx, the next request goes to the next server; a real HTTP server on
loopback stands for the live one."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hai.agent.client import AgentClient, ServerUnavailable, server_urls
from hai.protocol import LogBatch


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class _Handler(BaseHTTPRequestHandler):
    status = 200
    seen: list[str] = []

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append(self.path)
        body = json.dumps({"accepted": 0} if self.status == 200 else {"detail": "the database is unavailable"}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def live():
    handler = type("H", (_Handler,), {"status": 200, "seen": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    srv.shutdown()
    srv.server_close()


def test_moves_to_the_next_server_when_one_is_down(live):
    url, handler = live
    dead = _dead_url()
    client = AgentClient(f"{dead}, {url}/", "tok")
    assert client.servers == [dead, url]
    batch = LogBatch(node="n0")
    with pytest.raises(ServerUnavailable):
        client.logs(batch)  # the first is down: the agent backs off and retries...
    assert client.logs(batch).accepted == 0  # ...on the next one
    assert client.server == url and handler.seen == ["/api/v1/agent/logs"]
    client.close()


def test_moves_on_after_a_5xx_too(live):
    url, handler = live
    handler.status = 503
    other = _dead_url()
    client = AgentClient(f"{url},{other}", "tok")
    with pytest.raises(ServerUnavailable, match="503"):
        client.logs(LogBatch(node="n0"))
    assert client.server == other
    client.close()


def test_one_url_or_a_list():
    assert server_urls("http://a:1") == ["http://a:1"]
    assert server_urls(" http://a:1/ ,http://b:2") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError):
        server_urls(" , ")
