"""One write a response (hai.api.http, issue 12): a response's head and body leave in one
``transport.write``, a streamed body still leaves as it is produced, and closing or aborting a
connection keeps the transport's own rules."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from hai.api.http import CoalescingHttpToolsProtocol, CoalescingTransport
from tests.conftest import uvicorn_thread


class _Recording:
    """A transport that records what reaches it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default=None):  # noqa: ANN001, ANN201
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


def _turn(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(asyncio.sleep(0))


def test_writes_of_one_turn_reach_the_transport_as_one() -> None:
    loop = asyncio.new_event_loop()
    try:
        real = _Recording()
        t = CoalescingTransport(real, loop)
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        t.write(b"")
        t.write(b"{}")
        assert real.writes == [] and t.get_write_buffer_size() == 40
        _turn(loop)
        assert real.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
        t.write(b"next")  # a later turn: its own write
        _turn(loop)
        assert real.writes[1:] == [b"next"]
        assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the transport's
    finally:
        loop.close()


def test_close_writes_what_is_held_first_and_abort_discards_it() -> None:
    loop = asyncio.new_event_loop()
    try:
        real = _Recording()
        t = CoalescingTransport(real, loop)
        t.write(b"head")
        t.write(b"body")
        t.close()
        assert real.writes == [b"headbody"] and real.closed
        _turn(loop)  # the scheduled flush finds nothing left
        assert real.writes == [b"headbody"]

        real = _Recording()
        t = CoalescingTransport(real, loop)
        t.write(b"head")
        t.abort()
        _turn(loop)
        assert real.writes == [] and real.aborted

        real = _Recording()
        t = CoalescingTransport(real, loop)
        t.write(b"head")
        real.closed = True  # closed underneath (the peer went away): nothing written to it
        _turn(loop)
        assert real.writes == []
    finally:
        loop.close()


async def _json(request):  # noqa: ANN001, ANN202
    return JSONResponse({"id": 7, "state": "queued"}, status_code=201)


_release = threading.Event()


async def _stream(request):  # noqa: ANN001, ANN202
    async def chunks():  # noqa: ANN202
        yield b"first\n"
        while not _release.is_set():  # the test releases the second chunk once it read the first
            await asyncio.sleep(0.01)
        yield b"second\n"
    return StreamingResponse(chunks(), media_type="text/plain")


_APP = Starlette(routes=[Route("/json", _json, methods=["POST"]), Route("/stream", _stream)])


class _Counted:
    """The socket transport with its writes counted (uvloop's transports are read-only)."""

    def __init__(self, transport, writes: list[bytes]) -> None:  # noqa: ANN001
        self._transport, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._transport, name)


def _recording_protocol(base: type, writes: list[bytes]) -> type:
    class Recorded(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport):  # noqa: ANN001, ANN202
            super().connection_made(_Counted(transport, writes))
    return Recorded


@pytest.mark.parametrize("protocol, writes_a_response", [(CoalescingHttpToolsProtocol, 1), (HttpToolsProtocol, 2)])
def test_a_response_is_one_write_to_the_socket(protocol: type, writes_a_response: int) -> None:
    """Through a real uvicorn server and keep-alive connection; uvicorn's own protocol, for
    comparison, writes the head and the body apart."""
    writes: list[bytes] = []
    with uvicorn_thread(_APP, http=_recording_protocol(protocol, writes), log_level="warning") as url:
        with httpx.Client(base_url=url) as client:
            for _ in range(3):
                r = client.post("/json", json={})
                assert r.status_code == 201 and r.json() == {"id": 7, "state": "queued"}
    assert len(writes) == 3 * writes_a_response
    if writes_a_response == 1:
        assert all(w.startswith(b"HTTP/1.1 201 Created\r\n") and w.endswith(b'{"id":7,"state":"queued"}')
                   for w in writes)


def test_a_streamed_body_leaves_as_it_is_produced() -> None:
    _release.clear()
    with uvicorn_thread(_APP, log_level="warning") as url:  # the fixture's default: the coalescing protocol
        with socket.create_connection((url.split("//")[1].split(":")[0], int(url.rsplit(":", 1)[1])),
                                      timeout=10) as sock:
            sock.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
            got = b""
            while b"first\n" not in got:  # the head and the first chunk, while the second waits
                data = sock.recv(65536)
                assert data, "connection closed before the first chunk"
                got += data
            assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"second" not in got
            _release.set()
            while not got.endswith(b"0\r\n\r\n"):
                data = sock.recv(65536)
                assert data
                got += data
            assert b"second\n" in got
