"""Per-model event counters in Redis (global across processes), exported as metrics."""

from __future__ import annotations

import contextlib

import redis

from batchgen.limits import redis_keys as keys

BUDGET_DENIALS = "budget_denials"
BUDGET_WAIT_S = "budget_wait_seconds"
SLOT_DENIALS = "slot_denials"
COOLDOWNS = "cooldowns"
RATE_LIMITED = "rate_limited"
TRANSIENT_ERRORS = "transient_errors"
PERMANENT_ERRORS = "permanent_errors"


def incr(client: redis.Redis, model: str, field: str, amount: float = 1) -> None:
    """Add to a counter; never raises (counters must not fail a call)."""
    try:
        if isinstance(amount, int):
            client.hincrby(keys.counters(model), field, amount)
        else:
            client.hincrbyfloat(keys.counters(model), field, amount)
    except redis.RedisError:
        pass


def read(client: redis.Redis, model: str) -> dict[str, float]:
    raw = client.hgetall(keys.counters(model))
    return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}


def record_rejection(client: redis.Redis, tenant: str, reason: str) -> None:
    """Count a refused submission (reason: the error code, e.g. ``tenant_over_quota``)."""
    with contextlib.suppress(redis.RedisError):
        client.hincrby(keys.rejections(), f"{reason}:{tenant}", 1)


def read_rejections(client: redis.Redis) -> dict[tuple[str, str], float]:
    """``{(tenant, reason): count}``."""
    out: dict[tuple[str, str], float] = {}
    for field, value in client.hgetall(keys.rejections()).items():
        text = field.decode() if isinstance(field, bytes) else field
        reason, _, tenant = text.partition(":")
        out[(tenant, reason)] = float(value)
    return out
