"""The API process's credential cache (services.auth.TokenCache, issue 12): per-kind lifetimes,
never past the token's expiry, and emptied by any revocation (the TOKENS topic's version)."""

from __future__ import annotations

from datetime import timedelta

from hai.db.base import utcnow
from hai.services.auth import Principal, TokenCache

ALICE = Principal(kind="user", user_id=1, name="alice", group="g", token_id=7)
NODE = Principal(kind="agent", name="agents", token_id=8)


def test_a_cached_credential_is_answered_until_the_tokens_topic_moves() -> None:
    cache = TokenCache(agent_ttl_s=60, user_ttl_s=60)
    cache.put("secret", ALICE, expires_at=None, version=(0, 3))
    assert cache.get("secret", version=(0, 3)) == ALICE
    assert cache.get("other", version=(0, 3)) is None
    assert cache.get("secret", version=(0, 4)) is None  # a token was revoked somewhere
    assert cache.get("secret", version=(1, 3)) is None  # notifications may have been lost


def test_an_entry_never_outlives_its_token() -> None:
    cache = TokenCache(agent_ttl_s=60, user_ttl_s=60)
    cache.put("gone", ALICE, expires_at=utcnow() - timedelta(seconds=1), version=(0, 0))
    assert cache.get("gone", version=(0, 0)) is None
    cache.put("later", ALICE, expires_at=utcnow() + timedelta(hours=1), version=(0, 0))
    assert cache.get("later", version=(0, 0)) == ALICE


def test_each_kind_has_its_own_lifetime_and_zero_turns_it_off() -> None:
    cache = TokenCache(agent_ttl_s=60, user_ttl_s=0)
    cache.put("user", ALICE, expires_at=None, version=(0, 0))
    cache.put("node", NODE, expires_at=None, version=(0, 0))
    assert cache.get("user", version=(0, 0)) is None
    assert cache.get("node", version=(0, 0)) == NODE
