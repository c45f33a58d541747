"""uvicorn's httptools protocol with a response's head and body sent in one write (issue 12).

uvicorn writes a response's status line and headers to the socket when the application sends
``http.response.start``, and its body on ``http.response.body``: two ``send()`` system calls, two
TCP segments and two reads for the client, for every answer of a few hundred bytes. (The ASGI
specification lets a server hold the head until the first body message; uvicorn does not;
aiohttp's server coalesces them for small responses.)

Here the head of a response with a length (``content-length``: a JSON answer, whose body the
application sends whole right after it) is held and written with the body, in one write; the
head of a streamed response (chunked: log follow over server-sent events) is written at once, as
uvicorn writes it, so that a client sees it before the first event. A held head is written at the
latest when its response is complete (a HEAD request's, an empty body's) or the connection ends.
What it saves: ``benchmarks/response_writes.py``."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """A transport that holds the head of a response with a length (``content-length``: its body
    comes whole, in the next write) and hands it to the real one with that write."""

    __slots__ = ("_transport", "_held", "is_closing")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None  # a response's head, waiting for its body
        self.is_closing = transport.is_closing  # (asked after every response: not through __getattr__)

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data[:5] == b"HTTP/" and _LENGTH in data:
            self._held = bytes(data)
        elif data:
            self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Send a held head now (its response is complete: a HEAD request's, or an empty body's)."""
        held, self._held = self._held, None
        if held is not None and not self.is_closing():
            self._transport.write(held)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


_LENGTH = b"\r\ncontent-length: "  # (uvicorn writes header names in lower case)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a ``CoalescingTransport``: a response's head and body in
    one write when the response has a length; streamed responses (chunked: server-sent events)
    written as uvicorn writes them."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport))  # type: ignore[arg-type]

    def on_response_complete(self) -> None:
        self.transport.flush()  # type: ignore[attr-defined]  # (a head whose body was empty)
        super().on_response_complete()


# the ``http`` argument of uvicorn's Config for ``hai server`` and ``hai dev`` (httptools comes with
# uvicorn[standard], a dependency of the package)
HTTP_PROTOCOL = "hai.api.http_protocol:CoalescingHttpToolsProtocol"
