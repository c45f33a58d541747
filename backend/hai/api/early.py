"""Requests answered before routing (issue 12): the two that come by the thousand a second.

At 1,250 agents nearly every request is a steady heartbeat, and a CI that submits in bursts sends
one job per request; in both, FastAPI's and Starlette's layers around the route (routing,
dependency resolution, the middleware stack and its wrapped ``send``) were a large share of the
server's CPU: two thirds of a cached heartbeat's (py-spy ``--gil`` of the workers), a fifth of a
submission's instructions (callgrind, benchmarks/README.md). ``EarlyAnswer`` recognises such a
request by its method and exact path, a bearer credential already in this process's token cache
(of the kind the route takes), a JSON body, and whatever the subclass asks for, and answers it by
the route's own rules; anything else (no or unknown credential, another body, a header the fast
path leaves to the route) goes on to the application unchanged, with the body as read, so the
route's errors and special cases stay the route's. Installed just inside ``BodyLimit`` and outside
FastAPI's and Starlette's middleware (``hai.main._App``): the body is within the limit here, and
``owner`` is the application whose state (platform, caches) it reads."""

from __future__ import annotations

from fastapi import Request
from fastapi.security.utils import get_authorization_scheme_param
from starlette.responses import Response

from hai.api import deps
from hai.services import auth


class EarlyAnswer:
    """Pure ASGI middleware; a subclass sets ``method``, ``path`` and ``principal_kind`` and
    implements ``answer``. ``answered`` counts the requests it answered itself."""

    method = "POST"
    path = ""
    principal_kind = "user"

    def __init__(self, app, *, owner) -> None:  # noqa: ANN001
        self.app = app
        self.owner = owner
        self.answered = 0

    def applies(self, request: Request, platform) -> bool:  # noqa: ANN001
        """Before the body is read: whether this request may be answered here at all."""
        return True

    async def answer(self, request: Request, platform, principal: auth.Principal,  # noqa: ANN001
                     body: bytes) -> tuple[int, bytes] | Response | None:
        """(status, JSON body) of the answer, a response, or None: the application answers instead."""
        raise NotImplementedError

    async def handled(self, request: Request, exc: Exception) -> Response:
        """The application's answer to ``exc`` raised by the route's work: its exception handler's
        response (as Starlette's ExceptionMiddleware finds it: the nearest class in the MRO), or
        ``exc`` raised on (as from the route: the server answers 500)."""
        handlers = self.owner.exception_handlers
        for cls in type(exc).__mro__:
            if cls in handlers:
                return await handlers[cls](request, exc)  # the application's handlers are coroutines
        raise exc

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != self.method:
            return await self.app(scope, receive, send)
        scope["app"] = self.owner  # as Starlette sets it, for the Request below and the app inside
        request = Request(scope)
        platform = self.owner.state.platform
        headers = dict(scope["headers"])  # a repeated header: the last (the fast paths read one of each)
        authorization = headers.get(b"authorization")
        content_type = headers.get(b"content-type")
        if platform is None or authorization is None or content_type is None \
                or content_type.split(b";", 1)[0].strip().lower() != b"application/json" \
                or not self.applies(request, platform):
            return await self.app(scope, receive, send)
        scheme, token = get_authorization_scheme_param(authorization.decode("latin-1"))
        if scheme.lower() != "bearer" or not token:
            return await self.app(scope, receive, send)
        principal = deps._token_cache(request, platform).get(token, version=deps._tokens_version(platform))
        if principal is None or principal.kind != self.principal_kind:
            return await self.app(scope, receive, send)

        messages = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break

        async def replay():  # noqa: ANN202 - the body as read, then the connection's own messages
            return messages.pop(0) if messages else await receive()

        if messages[-1]["type"] != "http.request":  # the client went away
            return await self.app(scope, replay, send)
        answer = await self.answer(request, platform, principal, b"".join(m.get("body", b"") for m in messages))
        if answer is None:
            return await self.app(scope, replay, send)
        self.answered += 1
        if isinstance(answer, Response):
            return await answer(scope, replay, send)
        status, body = answer
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(body)).encode()),
                                (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
