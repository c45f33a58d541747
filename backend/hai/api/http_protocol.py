"""uvicorn's httptools protocol with each response's head and body sent in one write (issue 12).

uvicorn writes a response's status line and headers to the socket when the application sends
``http.response.start``, and its body on ``http.response.body``: two ``send()`` system calls, two
TCP segments and two reads for the client, for every answer of a few hundred bytes. Profiled
under ``benchmarks/api_load.py`` (py-spy, 8 submissions in flight), the two writes were 16% of an
API worker's CPU, the largest single cost of a submission in the worker. (The ASGI specification
lets a server hold the head until the first body message; uvicorn does not, and aiohttp's server
coalesces them the same way for small responses.)

Here the writes one event-loop step makes are gathered and handed to the real transport
together at the start of the next step (``loop.call_soon``): a response whose head and body the
application sends in one step (every JSON answer) leaves in one write; a streamed response (log
follow over SSE) has its head sent at once, a step later, however long its first event takes.
Anything that ends the connection sends what is gathered first."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """A transport whose writes within one event-loop step reach the real one as one write."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None  # written this step, not yet handed over

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self.flush)
        else:
            self._pending.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending or ()))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a ``CoalescingTransport``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]


# the ``http`` argument of uvicorn's Config for ``hai server`` and ``hai dev``: uvicorn's own
# choice ("auto": httptools when installed, else h11) where httptools is missing
HTTP_PROTOCOL = "hai.api.http_protocol:CoalescingHttpToolsProtocol"
