"""One write a response (issue 12): uvicorn's HTTP protocol with a response's head and body sent
together.

uvicorn's httptools protocol writes a response's status line and headers when the application
sends ``http.response.start`` and its body when it sends ``http.response.body``: two
``transport.write`` calls, and since asyncio's transport writes at once when nothing is buffered
(and sets ``TCP_NODELAY``), two ``send`` system calls and two TCP segments for every answer of a
few hundred bytes, which the client then reads in two. A py-spy profile of ``hai server``'s
workers under ``benchmarks/api_load.py`` (PostgreSQL, 8 submissions in flight) had 17-22% of
their samples on those two lines. ``CoalescingTransport`` holds what is written until the event
loop's next turn (``call_soon``) and writes it then in one call, so the head and the body that an
application sends one after the other, without waiting in between, leave together; a streamed
body (log follow, SSE) still leaves as it is produced (a chunk waits for the loop's next turn,
not for the next chunk). Closing writes what is held first, as the transport's own ``close``
writes its buffer; ``abort`` discards it, as the transport's own does."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """Wraps an asyncio transport: ``write`` collects, the loop's next turn writes; everything
    else is the transport's."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def writelines(self, lines) -> None:  # noqa: ANN001
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Write what is held, in one call (nothing when the transport is closed meanwhile)."""
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def __getattr__(self, name: str):  # noqa: ANN204 - is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a ``CoalescingTransport`` (``uvicorn.Config(http=...)``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
