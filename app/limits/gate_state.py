"""The gate's state marker and its rebuild in Redis (``lua/gate_rebuild.lua``).

The marker (:func:`batchgen.limits.redis_keys.gate_state`) says the gate's budgets
and slots in Redis are known good. A process that finds it missing takes the
rebuild lock (``SET NX``, in the gate's slot), reads the database's evidence and
rebuilds (app/worker/gate_recovery.py); the others wait for the marker a moment.
What to rebuild is decided in :mod:`batchgen.domain.scheduling.gate_rebuild`.
"""

from __future__ import annotations

import secrets

import redis

from batchgen.domain.scheduling.gate_rebuild import RebuildPlan
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import script


def is_known_good(client: redis.Redis) -> bool:
    """The marker is set: nothing to rebuild."""
    return bool(client.exists(keys.gate_state()))


def take_lock(client: redis.Redis, ttl_s: float) -> str | None:
    """The rebuild lock's token, or None when another process holds the lock."""
    token = secrets.token_hex(8)
    taken = client.set(keys.gate_rebuild_lock(), token, nx=True, px=max(1, int(ttl_s * 1000)))
    return token if taken else None


def rebuild(
    client: redis.Redis, plan: RebuildPlan, token: str, window_s: float, guard_s: float
) -> bool:
    """Write ``plan`` and set the marker, in one script: True when done, False when the
    marker was already set or the lock is no longer ``token``'s."""
    keys_ = [keys.gate_state(), keys.gate_rebuild_lock()]
    args: list[str | int | float] = [token, window_s, guard_s, len(plan.budgets)]
    for b in plan.budgets:
        keys_ += [
            keys.budget_log(b.budget_key),
            keys.budget_amounts(b.budget_key),
            keys.budget_bucket(b.budget_key),
        ]
        args += [b.tokens, b.requests]
    for s in plan.slots:
        keys_.append(keys.slots(s.slot_key))
        args += [s.holder, s.lease_s]
    return bool(script(client, "gate_rebuild")(keys=keys_, args=args))
