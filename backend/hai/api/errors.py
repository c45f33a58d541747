"""Map service errors to HTTP. Invalid becomes a 422 shaped like FastAPI's own."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hai.services.errors import ChecksFailed, Invalid, ServiceError, TooMany, Unauthorized


def install(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_request: Request, exc: ServiceError) -> JSONResponse:
        if isinstance(exc, Invalid):
            body = {"detail": [{"loc": ["body", *exc.field.split(".")], "msg": exc.message, "type": "value_error"}]}
            return JSONResponse(body, status_code=422)
        if isinstance(exc, ChecksFailed):
            return JSONResponse({"detail": exc.body}, status_code=exc.status_code)
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
        if isinstance(exc, TooMany) and exc.retry_after_s is not None:
            headers = {"Retry-After": str(exc.retry_after_s)}
        return JSONResponse({"detail": exc.message}, status_code=exc.status_code, headers=headers)
