"""Map service errors to HTTP. Invalid becomes a 422 shaped like FastAPI's own."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from hai.protocol import PROTOCOLS_HEADER
from hai.services.errors import ChecksFailed, Invalid, ServiceError, TooMany, Unauthorized, UnsupportedProtocol


log = logging.getLogger(__name__)

DB_UNAVAILABLE = "the database is unavailable; nothing was changed by this request; retry shortly"
DB_RETRY_AFTER_S = 5


def database_unavailable(exc: Exception) -> bool:
    """The database cannot be reached (down, restarting, connection dropped, pool exhausted),
    as opposed to a bug in a query."""
    if isinstance(exc, (OperationalError, PoolTimeout)):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def _json_safe(value: object) -> object:
    """A validation error's echo of the input, with numbers JSON cannot hold (infinity, NaN: a body
    may spell them 1e400 or NaN) as text: FastAPI's own 422 failed to encode them and answered 500."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _json_safe(jsonable_encoder(exc.errors()))}, status_code=422)

    @app.exception_handler(DBAPIError)
    @app.exception_handler(PoolTimeout)
    async def _database_error(request: Request, exc: Exception) -> JSONResponse:
        # issue 13: the database away (restarted, failed over) is a 503 with a clear message and
        # Retry-After, never a 500 with a traceback; the transaction was rolled back
        if not database_unavailable(exc):
            raise exc
        log.warning("database unavailable during %s %s: %s", request.method, request.url.path,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return JSONResponse({"detail": DB_UNAVAILABLE}, status_code=503,
                            headers={"Retry-After": str(DB_RETRY_AFTER_S)})

    @app.exception_handler(ServiceError)
    async def _service_error(_request: Request, exc: ServiceError) -> JSONResponse:
        if isinstance(exc, Invalid):
            loc = ["body", *(int(part) if part.isdigit() else part for part in exc.field.split("."))]
            body = {"detail": [{"loc": loc, "msg": exc.message, "type": "value_error"}]}
            return JSONResponse(body, status_code=422)
        if isinstance(exc, ChecksFailed):
            return JSONResponse({"detail": exc.body}, status_code=exc.status_code)
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
        if isinstance(exc, UnsupportedProtocol):  # the versions an agent may speak instead (issue 12)
            headers = {PROTOCOLS_HEADER: ",".join(str(v) for v in sorted(exc.supported))}
        if isinstance(exc, TooMany) and exc.retry_after_s is not None:
            headers = {"Retry-After": str(exc.retry_after_s)}
        return JSONResponse({"detail": exc.message}, status_code=exc.status_code, headers=headers)
