"""Which running items a live worker still holds, in Redis (app/worker/heartbeat.py).

A worker's heartbeat sets one key per item whose call it has in flight
(:func:`batchgen.limits.redis_keys.running_item`: the attempt number, expiring a
running lease after the last renewal). The sweep reads them before it takes back
running items whose PostgreSQL lease ran out: a lease that ran out while
PostgreSQL was unreachable, with its owner alive, is not a lost worker.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from batchgen.limits import redis_keys as keys


def renew(client: redis.Redis, held: Iterable[tuple[int, int, float]]) -> None:
    """Set the key of each ``(item_id, attempt, ttl_s)`` (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for item_id, attempt, ttl_s in held:
        pipe.set(keys.running_item(item_id), attempt, px=max(1, int(ttl_s * 1000)))
    pipe.execute()


def drop(client: redis.Redis, item_id: int) -> None:
    """The worker is done with the item: its key goes."""
    client.delete(keys.running_item(item_id))


def alive(client: redis.Redis, attempts: Iterable[tuple[int, int]]) -> set[int]:
    """Of ``(item_id, attempt)``, the items whose attempt a live worker still holds."""
    pairs = list(attempts)
    if not pairs:
        return set()
    values = client.mget([keys.running_item(item_id) for item_id, _ in pairs])
    return {
        item_id
        for (item_id, attempt), value in zip(pairs, values, strict=True)
        if value is not None and int(value) == attempt
    }
