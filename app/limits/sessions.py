"""Dashboard sessions and the sign-in limit, over Redis (keys in :mod:`redis_keys`).

A session is a random token in the browser's cookie and, here, only its hash with
the tenant id, expiring by itself; signing out deletes it, so a copied cookie dies
with the session. The sign-in limit is a counter per client address and per key
that opens a window at its first attempt.
"""

from __future__ import annotations

import hashlib
import math
import secrets

import redis

from batchgen.limits import redis_keys as keys

TOKEN_BYTES = 32


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create(client: redis.Redis, tenant_id: int, ttl_s: float, key_id: int | None = None) -> str:
    """A new session of ``tenant_id``, signed in with the API key ``key_id``, for
    ``ttl_s`` seconds; returns its token."""
    token = secrets.token_urlsafe(TOKEN_BYTES)
    value = f"{tenant_id}:{key_id}" if key_id is not None else str(tenant_id)
    client.set(keys.dashboard_session(token_hash(token)), value, px=int(ttl_s * 1000))
    return token


def tenant_of(client: redis.Redis, token: str) -> int | None:
    """The tenant id of a live session, None for an unknown or expired token."""
    found = of(client, token)
    return found[0] if found is not None else None


def of(client: redis.Redis, token: str) -> tuple[int, int | None] | None:
    """The tenant id and the key id (None: not recorded) of a live session, None for an
    unknown or expired token."""
    raw = client.get(keys.dashboard_session(token_hash(token)))
    if raw is None:
        return None
    tenant, _, key = (raw.decode() if isinstance(raw, bytes) else str(raw)).partition(":")
    return int(tenant), (int(key) if key else None)


def delete(client: redis.Redis, token: str) -> None:
    client.delete(keys.dashboard_session(token_hash(token)))


def count_attempt(client: redis.Redis, kind: str, value: str, window_s: float) -> tuple[int, float]:
    """Count one sign-in attempt for ``value`` (an address or a key); returns the
    attempts in the current window, this one included, and the seconds it has left."""
    key = keys.signin_attempts(kind, token_hash(value))
    pipe = client.pipeline(transaction=True)
    pipe.incr(key)
    pipe.pttl(key)
    count, ttl_ms = pipe.execute()
    if ttl_ms is None or ttl_ms < 0:  # the window's first attempt (PEXPIRE NX needs Redis 7)
        client.pexpire(key, int(window_s * 1000))
        return int(count), window_s
    return int(count), ttl_ms / 1000.0


def retry_after_s(seconds: float) -> int:
    """Whole seconds for a Retry-After header (at least 1)."""
    return max(1, math.ceil(seconds))
