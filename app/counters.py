"""Per-model event counters in Redis (global across processes), exported as metrics."""

from __future__ import annotations

import redis

from app import keys

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
