"""The API's HTTP protocol (``hai.api.http_protocol``): a response's head and body reach the
socket in one write, a streamed response's head is sent before its first chunk exists, and a
connection that closes after its response loses none of it. Served by a real uvicorn server on a
real socket; the writes are counted where they reach uvicorn's own transport."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from hai.api.http_protocol import CoalescingHttpToolsProtocol
from tests.conftest import uvicorn_thread


class _Recorded:
    """The server's real transport, its writes recorded (each write is one send to the socket)."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self._t, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._t.write(data)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._t, name)


def _counting(base: type[HttpToolsProtocol], writes: list[bytes]) -> type[HttpToolsProtocol]:
    class Counting(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport):  # noqa: ANN001, ANN202
            super().connection_made(_Recorded(transport, writes))

    return Counting


def _app() -> tuple[Starlette, dict]:
    state: dict = {}

    async def job(request):  # noqa: ANN001, ANN202
        return JSONResponse({"id": 1, "state": "queued", "pending_reason": "waiting for the scheduler"}, status_code=201)

    async def stream(request):  # noqa: ANN001, ANN202
        state["release"] = release = asyncio.Event()

        async def body():  # noqa: ANN202
            await release.wait()  # the first chunk exists only once the test has seen the head
            yield b"data: first\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def release(request):  # noqa: ANN001, ANN202
        state["release"].set()
        return JSONResponse({})

    async def empty(request):  # noqa: ANN001, ANN202
        return Response(status_code=204)

    return Starlette(routes=[Route("/job", job, methods=["GET", "HEAD", "POST"]), Route("/stream", stream),
                             Route("/release", release, methods=["POST"]), Route("/empty", empty, methods=["DELETE"])]), state


@pytest.mark.parametrize(("protocol", "writes_per_response"), [(CoalescingHttpToolsProtocol, 1), (HttpToolsProtocol, 2)])
def test_a_json_answer_leaves_in_one_write_where_uvicorns_own_protocol_makes_two(protocol, writes_per_response):  # noqa: ANN001
    writes: list[bytes] = []
    app, _ = _app()
    with uvicorn_thread(app, http=_counting(protocol, writes), log_level="warning") as url, \
            httpx.Client(base_url=url, timeout=10) as c:
        for _ in range(3):  # keep-alive: three answers on one connection
            r = c.post("/job", json={"command": "sleep 1"})
            assert r.status_code == 201 and r.json()["state"] == "queued"
    assert len(writes) == 3 * writes_per_response
    if writes_per_response == 1:
        head, _, body = writes[0].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 201 ") and body == r.content


def test_a_streamed_answer_has_its_head_sent_before_its_first_chunk_exists():
    writes: list[bytes] = []
    app, _state = _app()
    with uvicorn_thread(app, http=_counting(CoalescingHttpToolsProtocol, writes), log_level="warning") as url, \
            httpx.Client(base_url=url, timeout=10) as c, httpx.Client(base_url=url, timeout=10) as other:
        # ``stream`` returns once the head has arrived: were the head held until the body, this
        # would wait for a chunk that only the release below makes (a timeout, not a hang)
        with c.stream("GET", "/stream") as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert writes and writes[0].startswith(b"HTTP/1.1 200 ")
            assert other.post("/release").status_code == 200
            assert b"".join(r.iter_bytes()) == b"data: first\n\n"


def test_answers_without_a_body_are_sent_whole_on_a_kept_alive_connection():
    """A HEAD answer (a length, no body written) and a 204: the held head is sent when the
    response completes, not when the next request comes or the idle connection is closed (each
    would time out otherwise: the connection is kept well past the client's timeout)."""
    writes: list[bytes] = []
    app, _ = _app()
    with uvicorn_thread(app, http=_counting(CoalescingHttpToolsProtocol, writes), log_level="warning",
                        timeout_keep_alive=60) as url, \
            httpx.Client(base_url=url, timeout=5) as c:
        head = c.head("/job")
        assert head.status_code == 201 and int(head.headers["content-length"]) > 0 and head.content == b""
        assert c.delete("/empty").status_code == 204
        assert c.get("/job").json()["state"] == "queued"
    assert len(writes) == 3


def test_a_connection_closed_after_its_answer_gets_the_whole_answer():
    app, _ = _app()
    with uvicorn_thread(app, log_level="warning") as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /job HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            got = b""
            while chunk := s.recv(65536):  # until the server closes the connection
                got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 201 ") and b"connection: close" in head.lower()
    assert body == b'{"id":1,"state":"queued","pending_reason":"waiting for the scheduler"}'
