"""Dependencies as Annotated aliases: SessionDep, CurrentUser, AdminUser, AgentPrincipal."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Annotated, Iterator

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from hai.services import auth, notify
from hai.services.context import Platform
from hai.services.errors import Forbidden, Unauthorized

_bearer = HTTPBearer(auto_error=False, description="an API token (`hai admin create-user` or POST /api/v1/tokens)")


async def get_platform(request: Request) -> Platform:
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
    cache = _token_cache(request, platform)
    version = _tokens_version(platform)
    known = cache.get(creds.credentials, version=version)
    if known is not None:
        return known  # a cached credential: no database, no worker thread
    return await run_in_threadpool(_lookup, request, platform, creds, cache, version)


def _tokens_version(platform: Platform) -> tuple[int, int]:
    notifier = platform.notifier
    return notifier.epoch, notifier.version(notify.TOKENS)


def _lookup(request: Request, platform: Platform, creds: HTTPAuthorizationCredentials,
            cache: auth.TokenCache, version: tuple[int, int], session: Session | None = None) -> auth.Principal:
    """In a worker thread. ``session``: look the token up in the request's own session (the
    submission path, issue 12: one connection and one thread hop for the whole request) instead of a
    read session of its own. ``version``: the TOKENS topic's, read before the look-up."""
    failures = request.app.state.auth_failures  # issue 13: 429 for a client guessing tokens
    client = request.client.host if request.client else "unknown"
    failures.check(client)
    with nullcontext(session) if session is not None else platform.read_sessions() as s:
        try:
            principal = auth.authenticate(session=s, secret=creds.credentials)
        except Unauthorized:
            failures.failed(client)
            raise
    cache.put(creds.credentials, principal, expires_at=principal.expires_at, version=version)
    if principal.stale_use and principal.token_id is not None:  # a write at most once a minute per token
        if session is not None:
            auth.touch_token(session=session, token_id=principal.token_id, commit=False)
        else:
            with platform.sessions() as touch:
                auth.touch_token(session=touch, token_id=principal.token_id)
    return principal


def user_in_thread(request: Request, platform: Platform, creds: HTTPAuthorizationCredentials,
                   session: Session) -> auth.Principal:
    """What CurrentUser resolves to, for a route that does its whole work in one worker thread
    and one session (POST /api/v1/jobs): the same checks, errors and 429s."""
    cache = _token_cache(request, platform)
    version = _tokens_version(platform)
    principal = cache.get(creds.credentials, version=version) or _lookup(
        request, platform, creds, cache, version, session)
    return _users_only(principal)


def _token_cache(request: Request, platform: Platform) -> auth.TokenCache:
    cache = getattr(request.app.state, "token_cache", None)
    if cache is None:
        a = platform.settings.auth
        cache = request.app.state.token_cache = auth.TokenCache(
            agent_ttl_s=a.agent_token_cache_s, user_ttl_s=a.token_cache_s)
    return cache


def _users_only(principal: auth.Principal) -> auth.Principal:
    if principal.kind != "user":
        raise Forbidden("this endpoint is for users; agent credentials can only act for agents")
    return principal


async def _user(principal: Annotated[auth.Principal, Depends(_principal)]) -> auth.Principal:
    return _users_only(principal)


async def _admin(user: Annotated[auth.Principal, Depends(_user)]) -> auth.Principal:
    if not user.is_admin:
        raise Forbidden("admins only")
    return user


async def _agent(principal: Annotated[auth.Principal, Depends(_principal)]) -> auth.Principal:
    if principal.kind != "agent":
        raise Forbidden("agent endpoints need the node credential")
    return principal


CurrentUser = Annotated[auth.Principal, Depends(_user)]


async def _credentials(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> HTTPAuthorizationCredentials:
    if creds is None:
        raise Unauthorized("missing bearer token")
    return creds


# the bearer credentials, present but not yet looked up (user_in_thread does that)
BearerCredentials = Annotated[HTTPAuthorizationCredentials, Depends(_credentials)]
AdminUser = Annotated[auth.Principal, Depends(_admin)]
AgentPrincipal = Annotated[auth.Principal, Depends(_agent)]
