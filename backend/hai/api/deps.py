"""Dependencies as Annotated aliases: SessionDep, CurrentUser, AdminUser, AgentPrincipal."""

from __future__ import annotations

from typing import Annotated, Iterator

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from hai.services import auth
from hai.services.context import Platform
from hai.services.errors import Forbidden, Unauthorized

_bearer = HTTPBearer(auto_error=False, description="an API token (`hai admin create-user` or POST /api/v1/tokens)")


def get_platform(request: Request) -> Platform:
    return request.app.state.platform


PlatformDep = Annotated[Platform, Depends(get_platform)]


READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def get_session(request: Request, platform: PlatformDep) -> Iterator[Session]:
    """GET requests only read: their session begins deferred on SQLite (no write lock)."""
    factory = platform.read_sessions if request.method in READ_METHODS else platform.sessions
    with factory() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


async def _principal(
    request: Request, platform: PlatformDep, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> auth.Principal:
    if creds is None:
        raise Unauthorized("missing bearer token")
    cache = _agent_cache(request, platform)
    known = cache.get(creds.credentials)
    if known is not None:
        return known  # a cached node credential: no database, no worker thread
    return await run_in_threadpool(_lookup, request, platform, creds, cache)


def _lookup(request: Request, platform: Platform, creds: HTTPAuthorizationCredentials,
            cache: auth.AgentTokenCache) -> auth.Principal:
    failures = request.app.state.auth_failures  # issue 13: 429 for a client guessing tokens
    client = request.client.host if request.client else "unknown"
    failures.check(client)
    with platform.read_sessions() as session:
        try:
            principal = auth.authenticate(session=session, secret=creds.credentials)
        except Unauthorized:
            failures.failed(client)
            raise
        cache.put(session, creds.credentials, principal)
    if principal.stale_use and principal.token_id is not None:
        with platform.sessions() as session:  # a write at most once a minute per token
            auth.touch_token(session=session, token_id=principal.token_id)
    return principal


def _agent_cache(request: Request, platform: Platform) -> auth.AgentTokenCache:
    cache = getattr(request.app.state, "agent_tokens", None)
    if cache is None:
        cache = request.app.state.agent_tokens = auth.AgentTokenCache(platform.settings.auth.agent_token_cache_s)
    return cache


def _user(principal: Annotated[auth.Principal, Depends(_principal)]) -> auth.Principal:
    if principal.kind != "user":
        raise Forbidden("this endpoint is for users; agent credentials can only act for agents")
    return principal


def _admin(user: Annotated[auth.Principal, Depends(_user)]) -> auth.Principal:
    if not user.is_admin:
        raise Forbidden("admins only")
    return user


def _agent(principal: Annotated[auth.Principal, Depends(_principal)]) -> auth.Principal:
    if principal.kind != "agent":
        raise Forbidden("agent endpoints need the node credential")
    return principal


CurrentUser = Annotated[auth.Principal, Depends(_user)]
AdminUser = Annotated[auth.Principal, Depends(_admin)]
AgentPrincipal = Annotated[auth.Principal, Depends(_agent)]
