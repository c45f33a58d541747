"""Users and bearer tokens. Tokens are random 256-bit secrets; only their SHA-256 is stored
(like GitHub's personal access tokens), shown once at creation, revocable."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from hai.db.base import utcnow
from hai.db.models import ApiToken, User
from hai.services import notify
from hai.services.errors import Conflict, Forbidden, Invalid, NotFound, Unauthorized

TOKEN_PREFIX = "hai_"
# a token's last_used_at is written at most this often (issue 12): not a write per request
TOKEN_TOUCH_S = 60.0
AGENT_TOKEN_PREFIX = "haiagent_"


@dataclass(frozen=True)
class Principal:
    kind: str  # user | agent
    user_id: int | None = None
    name: str = ""
    group: str = ""
    is_admin: bool = False
    token_id: int | None = None
    # the token's last_used_at is older than TOKEN_TOUCH_S (or unset): touch_token it
    stale_use: bool = field(default=False, compare=False)
    expires_at: datetime | None = field(default=None, compare=False)  # the token's (TokenCache)


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def _store_token(
    session: Session, *, secret: str, kind: str, user_id: int | None, name: str, expires_in_s: float | None = None
) -> ApiToken:
    expires_at = utcnow() + timedelta(seconds=expires_in_s) if expires_in_s is not None else None
    token = ApiToken(
        kind=kind, user_id=user_id, name=name, token_hash=hash_token(secret), prefix=secret[:12], expires_at=expires_at
    )
    session.add(token)
    session.flush()
    return token


def create_user(*, session: Session, name: str, group: str, is_admin: bool = False) -> tuple[User, str]:
    """Create a user and their first token; returns (user, secret)."""
    if not name or not group:
        raise Invalid("name", "user name and group must not be empty")
    if session.scalar(select(User).where(User.name == name)) is not None:
        raise Conflict(f"user '{name}' already exists")
    user = User(name=name, group=group, is_admin=is_admin)
    session.add(user)
    session.flush()
    secret = _new_secret(TOKEN_PREFIX)
    _store_token(session, secret=secret, kind="user", user_id=user.id, name="initial")
    session.commit()
    return user, secret


def ensure_user_token(*, session: Session, name: str, group: str, is_admin: bool, secret: str) -> User:
    """Make sure ``name`` exists and ``secret`` is one of its tokens (dev mode and bootstrap)."""
    user = session.scalar(select(User).where(User.name == name))
    if user is None:
        user = User(name=name, group=group, is_admin=is_admin)
        session.add(user)
        session.flush()
    if session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(secret))) is None:
        _store_token(session, secret=secret, kind="user", user_id=user.id, name="bootstrap")
    session.commit()
    return user


def ensure_agent_token(*, session: Session, secret: str, name: str = "agents") -> None:
    if session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(secret))) is None:
        _store_token(session, secret=secret, kind="agent", user_id=None, name=name)
        session.commit()


def create_agent_token(*, session: Session, name: str = "agents") -> str:
    secret = _new_secret(AGENT_TOKEN_PREFIX)
    _store_token(session, secret=secret, kind="agent", user_id=None, name=name)
    session.commit()
    return secret


def create_token(
    *, session: Session, principal: Principal, name: str, expires_in_s: float | None = None
) -> tuple[ApiToken, str]:
    if principal.kind != "user" or principal.user_id is None:
        raise Forbidden("only users can create personal tokens")
    secret = _new_secret(TOKEN_PREFIX)
    token = _store_token(
        session, secret=secret, kind="user", user_id=principal.user_id, name=name, expires_in_s=expires_in_s
    )
    session.commit()
    return token, secret


def list_tokens(*, session: Session, principal: Principal) -> list[ApiToken]:
    return list(
        session.scalars(
            select(ApiToken).where(ApiToken.user_id == principal.user_id).order_by(ApiToken.id)
        )
    )


def revoke_token(*, session: Session, principal: Principal, token_id: int) -> ApiToken:
    token = session.get(ApiToken, token_id)
    if token is None or token.kind != "user":
        raise NotFound(f"token {token_id} not found")
    if token.user_id != principal.user_id and not principal.is_admin:
        raise Forbidden("you can only revoke your own tokens")
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        notify.publish_after_commit(session, notify.TOKENS)  # every API process drops its cached credentials
    session.commit()
    return token


_tokens, _users = ApiToken.__table__, User.__table__
# one statement object, built once: its compiled form and cache key are reused by every request
# (issue 12: building and keying the ORM query was most of a look-up's CPU)
_LOOKUP = (
    select(_tokens.c.id, _tokens.c.kind, _tokens.c.name, _tokens.c.token_hash, _tokens.c.revoked_at,
           _tokens.c.expires_at, _tokens.c.last_used_at, _users.c.id.label("user_id"),
           _users.c.name.label("user_name"), _users.c.group, _users.c.is_admin)
    .select_from(_tokens.outerjoin(_users, _tokens.c.user_id == _users.c.id))
    .where(_tokens.c.token_hash == bindparam("digest"))
)


def authenticate(*, session: Session, secret: str | None) -> Principal:
    if not secret:
        raise Unauthorized("missing bearer token")
    # the look-up is by SHA-256 of the secret (a timing difference reveals nothing about a
    # stored secret); the digest is compared again in constant time
    digest = hash_token(secret)
    token = session.connection().execute(_LOOKUP, {"digest": digest}).first()
    if token is None or not hmac.compare_digest(token.token_hash, digest) or token.revoked_at is not None:
        raise Unauthorized("invalid or revoked token")
    now = utcnow()
    if token.expires_at is not None and token.expires_at <= now:
        raise Unauthorized("token expired")
    stale = token.last_used_at is None or token.last_used_at <= now - timedelta(seconds=TOKEN_TOUCH_S)
    if token.kind == "agent":
        return Principal(kind="agent", name=token.name, token_id=token.id, stale_use=stale,
                         expires_at=token.expires_at)
    assert token.user_id is not None
    return Principal(
        kind="user", user_id=token.user_id, name=token.user_name, group=token.group, is_admin=token.is_admin,
        token_id=token.id, stale_use=stale, expires_at=token.expires_at,
    )


def touch_token(*, session: Session, token_id: int, now: datetime | None = None, commit: bool = True) -> None:
    """Record that the token was used (called when ``Principal.stale_use``: once a minute at most).
    ``commit=False``: part of the caller's transaction (which commits it, or loses it on a
    rollback: the next use touches it again)."""
    now = now or utcnow()
    session.execute(
        update(ApiToken)
        .where(ApiToken.id == token_id)
        .where((ApiToken.last_used_at.is_(None)) | (ApiToken.last_used_at < now - timedelta(seconds=TOKEN_TOUCH_S)))
        .values(last_used_at=now)
    )
    if commit:
        session.commit()


class TokenCache:
    """Credentials checked once per ``ttl_s`` per API process instead of once per request (issue
    12: 1,250 agents at 1 Hz cost a token query per heartbeat; every user request paid a
    connection, a worker-thread hop and a query for it). ``ttl_s`` is per kind: node credentials
    and user tokens. An entry also stops at its token's expiry, and any revocation
    (``revoke_token`` publishes ``notify.TOKENS`` after its commit) empties every process's cache
    at once where notifications reach it (Redis, or the process that revoked); elsewhere the
    revoked token stops working within ``ttl_s``."""

    def __init__(self, *, agent_ttl_s: float, user_ttl_s: float) -> None:
        self._ttl = {"agent": agent_ttl_s, "user": user_ttl_s}
        self._entries: dict[str, tuple[float, Principal, tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def get(self, secret: str, *, version: tuple[int, int]) -> Principal | None:
        """``version``: (the notifier's epoch, the version of its TOKENS topic) now."""
        if not any(t > 0 for t in self._ttl.values()):
            return None
        key = hash_token(secret)
        with self._lock:
            hit = self._entries.get(key)
        if hit is None or hit[0] <= time.monotonic() or hit[2] != version:
            return None
        return hit[1]

    def put(self, secret: str, principal: Principal, *, expires_at: datetime | None,
            version: tuple[int, int]) -> None:
        """``version``: as read BEFORE the look-up, so a revocation in between is not missed."""
        ttl = self._ttl.get(principal.kind, 0.0)
        if ttl <= 0:
            return
        until = time.monotonic() + ttl
        if expires_at is not None:
            until = min(until, time.monotonic() + (expires_at - utcnow()).total_seconds())
        with self._lock:
            if len(self._entries) > 4096:
                self._entries.clear()
            self._entries[hash_token(secret)] = (until, principal, version)
