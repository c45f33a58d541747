"""Issue 13: limits against abuse at the edge of the API.

- ``BodyLimit``: a request body over ``limits.max_body_bytes`` is refused with 413 before any
  route reads it (by Content-Length, or by counting a chunked body).
- ``no_query_tokens``: a credential in the query string (``?token=``, ``?access_token=``...) is
  refused with 400; tokens are accepted only in the Authorization header, so they never land in
  access logs, browser history or proxies.
- ``AuthFailures``: a client (by address) that presented this many wrong, revoked or expired
  tokens within the window gets 429 with Retry-After (the ``limits`` library's moving window,
  in this process's memory).
- ``redact``: a logging filter that masks anything shaped like a token in every log record.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from urllib.parse import parse_qsl

from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from hai.protocol.messages import NUL_MSG
from hai.services.errors import TooMany
from hai.settings import LimitsSettings

QUERY_TOKEN_NAMES = frozenset({"token", "access_token", "api_key", "apikey", "auth", "authorization", "bearer"})
TOKEN_PATTERN = re.compile(r"\b(hai(?:agent)?_)[A-Za-z0-9_\-]{8,}")


async def _send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:  # noqa: ANN001
    payload = json.dumps(body).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": payload})


class BodyLimit:
    """Pure ASGI middleware (no buffering of accepted bodies that declare their length). Also
    refuses, before anything else reads them, a credential in the URL (400) and a NUL character
    in the path or a query parameter (422 naming it: PostgreSQL's text holds none, and psycopg's
    refusal to send one was a 500 on every look-up by name; a body's text fields are refused so
    by their schemas, ``schemas.common.Text``)."""

    def __init__(self, app, max_bytes: int):  # noqa: ANN001
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, send, size: str):  # noqa: ANN001, ANN202
        return _send_json(send, 413, {"detail": f"the request body is {size} bytes; at most {self.max_bytes} are accepted"})

    async def __call__(self, scope, receive, send):  # noqa: ANN001
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if "\0" in scope["path"]:
            return await _send_json(send, 422, {"detail": [{"loc": ["path"], "type": "value_error", "msg": NUL_MSG}]})
        query = scope.get("query_string", b"").decode("latin-1")
        for name, value in parse_qsl(query, keep_blank_values=True):
            if name.lower() in QUERY_TOKEN_NAMES:
                detail = [{"loc": ["query", name], "type": "value_error",
                           "msg": "credentials are accepted only in the Authorization header, never in the URL"}]
                return await _send_json(send, 400, {"detail": detail})
            if "\0" in name or "\0" in value:
                detail = [{"loc": ["query", name], "type": "value_error", "msg": NUL_MSG}]
                return await _send_json(send, 422, {"detail": detail})
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                return await self._too_large(send, length.decode())
            return await self.app(scope, receive, send)
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        # no Content-Length (chunked): read it, counting, then hand it on
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._too_large(send, f"more than {size}")
            if not message.get("more_body", False):
                break

        async def replay():  # noqa: ANN202
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


class AuthFailures:
    def __init__(self, limits: LimitsSettings):
        self.item = RateLimitItemPerSecond(limits.auth_failures, limits.auth_failure_window_s)
        self.limiter = MovingWindowRateLimiter(MemoryStorage())

    def check(self, client: str) -> None:
        if not self.limiter.test(self.item, client):
            reset_at, _ = self.limiter.get_window_stats(self.item, client)
            retry = max(1, math.ceil(reset_at - time.time()))
            raise TooMany(f"too many failed authentications from {client}; try again in {retry} s", retry_after_s=retry)

    def failed(self, client: str) -> None:
        self.limiter.hit(self.item, client)


def _mask(value: object) -> object:
    # every token starts "hai": a string without it has nothing to mask (the regex's scan skipped)
    return TOKEN_PATTERN.sub(r"\1***", value) if isinstance(value, str) and "hai" in value else value


class RedactTokens(logging.Filter):
    """Installed on loggers and on their handlers, so a record can meet it twice (at its logger,
    then at a handler): the second time finds it masked already and passes it on."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_hai_redacted", False):
            return True
        record._hai_redacted = True
        if isinstance(record.msg, str):
            record.msg = _mask(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_mask(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _mask(v) for k, v in record.args.items()}
        return True


def install_redaction() -> None:
    """Mask tokens in every record of the root logger's handlers and uvicorn's own loggers
    (called once the server has configured logging)."""
    flt = RedactTokens()
    for name in ("", "uvicorn", "uvicorn.access", "uvicorn.error", "hai"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(flt)
        for handler in logger.handlers:
            if not any(isinstance(f, RedactTokens) for f in handler.filters):
                handler.addFilter(flt)


class AllowHeader:
    """A 405 names every method the path supports in ``Allow`` (RFC 9110), not only those of the
    first route that matched the path (Starlette's answer; found by schemathesis, issue 13)."""

    def __init__(self, app, routes_of):  # noqa: ANN001
        self.app = app
        self.routes_of = routes_of  # () -> the app's routes, read when first needed
        self._paths: list[tuple[object, set[str]]] | None = None

    def _methods(self, path: str) -> set[str]:
        if self._paths is None:
            from fastapi.routing import iter_route_contexts
            from starlette.routing import compile_path

            paths: dict[str, set[str]] = {}
            for ctx in iter_route_contexts(self.routes_of()):
                if ctx.path and ctx.methods:
                    paths.setdefault(ctx.path, set()).update(ctx.methods)
            self._paths = [(compile_path(p)[0], m) for p, m in paths.items()]
        return {m for regex, methods in self._paths if regex.match(path) for m in methods}

    async def __call__(self, scope, receive, send):  # noqa: ANN001
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_allow(message):  # noqa: ANN001, ANN202
            if message["type"] == "http.response.start" and message["status"] == 405:
                methods = self._methods(scope["path"])
                if methods:
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                    headers.append((b"allow", ", ".join(sorted(methods)).encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_allow)
