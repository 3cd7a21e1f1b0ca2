"""Which running items a live worker still holds, in Redis (app/worker/heartbeat.py).

A worker's heartbeat sets one key per item whose call it has in flight
(:func:`batchgen.limits.redis_keys.running_item`: the attempt number, expiring a
running lease after the last renewal). The sweep reads them before it takes back
running items whose PostgreSQL lease ran out: a lease that ran out while
PostgreSQL was unreachable, with its owner alive, is not a lost worker.

A worker process renews one key naming the queues it consumes
(:func:`batchgen.limits.redis_keys.worker`): the status view lists the live workers
from them, without a Celery broadcast that waits for replies.

Likewise an API process renews one key per synchronous call whose caller waits in
it (:func:`batchgen.limits.redis_keys.call_caller`): a call whose lease ran out and
whose caller's key is gone is cancelled by the sweep, not run again for nobody.

And a streamed call's usage, as the provider reported it at the end of its stream, is
kept here as soon as it arrives (:func:`keep_usage`): if the process dies before it
records the answer, the sweep ledgers what the provider billed, not an estimate.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import redis

from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import mget


def renew(client: redis.Redis, held: Iterable[tuple[int, int, float]]) -> None:
    """Set the key of each ``(item_id, attempt, ttl_s)`` (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for item_id, attempt, ttl_s in held:
        pipe.set(keys.running_item(item_id), attempt, px=max(1, int(ttl_s * 1000)))
    pipe.execute()


def drop(client: redis.Redis, item_id: int) -> None:
    """The worker is done with the item: its key goes."""
    client.delete(keys.running_item(item_id))


def _marked(
    client: redis.Redis, key_of: Callable[[int], str], attempts: Iterable[tuple[int, int]]
) -> set[int]:
    """Of ``(item_id, attempt)``, the items whose key (``key_of(item_id)``) names that
    very attempt (one round trip)."""
    pairs = list(attempts)
    if not pairs:
        return set()
    values = mget(client, [key_of(item_id) for item_id, _ in pairs])
    return {
        item_id
        for (item_id, attempt), value in zip(pairs, values, strict=True)
        if value is not None and int(value) == attempt
    }


def alive(client: redis.Redis, attempts: Iterable[tuple[int, int]]) -> set[int]:
    """Of ``(item_id, attempt)``, the items whose attempt a live worker still holds."""
    return _marked(client, keys.running_item, attempts)


def mark_unsent(client: redis.Redis, item_id: int, claim_token: int, ttl_s: float) -> None:
    """The worker whose claim ``claim_token`` of the item may have committed (its reply
    was lost) never sent a request for it: for ``ttl_s``, the sweep is told so. The mark
    names that claim only: a later claim of the same attempt number is not covered."""
    client.set(keys.unsent_claim(item_id, claim_token), 1, px=max(1, int(ttl_s * 1000)))


def unsent(client: redis.Redis, claims: Iterable[tuple[int, int]]) -> set[int]:
    """Of ``(item_id, claim_token)``, the items whose claim a worker marked never sent
    (one round trip)."""
    pairs = list(claims)
    if not pairs:
        return set()
    values = mget(client, [keys.unsent_claim(item_id, token) for item_id, token in pairs])
    return {item_id for (item_id, _), value in zip(pairs, values, strict=True) if value}


def renew_caller(client: redis.Redis, item_id: int, ttl_s: float) -> None:
    """The caller of the call ``item_id`` still waits, for ``ttl_s`` more."""
    client.set(keys.call_caller(item_id), 1, px=max(1, int(ttl_s * 1000)))


def drop_caller(client: redis.Redis, item_id: int) -> None:
    """The caller has its answer (or its error): nobody waits any more."""
    client.delete(keys.call_caller(item_id))


def mark_run_by_caller(client: redis.Redis, item_id: int, attempt: int, ttl_s: float) -> None:
    """The process the call's caller waits in runs ``attempt`` of it itself."""
    client.set(keys.call_run_by_caller(item_id), attempt, px=max(1, int(ttl_s * 1000)))


def run_by_caller(client: redis.Redis, attempts: Iterable[tuple[int, int]]) -> set[int]:
    """Of ``(item_id, attempt)``, the calls whose attempt their caller's process runs."""
    return _marked(client, keys.call_run_by_caller, attempts)


def callers_waiting(client: redis.Redis, item_ids: Iterable[int]) -> set[int]:
    """Of ``item_ids`` (synchronous calls), those whose caller still waits."""
    ids = list(item_ids)
    if not ids:
        return set()
    values = mget(client, [keys.call_caller(item_id) for item_id in ids])
    return {item_id for item_id, value in zip(ids, values, strict=True) if value is not None}


def keep_usage(client: redis.Redis, item_id: int, attempt: int, usage: dict, ttl_s: float) -> None:
    """The provider reported ``usage`` (a JSON object) for ``attempt`` of the item: kept
    for ``ttl_s``."""
    value = json.dumps({"attempt": attempt, "usage": usage}, separators=(",", ":"))
    client.set(keys.stream_usage(item_id, attempt), value, px=max(1, int(ttl_s * 1000)))


def drop_usage(client: redis.Redis, item_id: int, attempt: int) -> None:
    """The attempt's answer was recorded: its kept usage is no longer needed."""
    client.delete(keys.stream_usage(item_id, attempt))


def kept_usage(client: redis.Redis, attempts: Iterable[tuple[int, int]]) -> dict[int, dict]:
    """Of ``(item_id, attempt)``, the usage kept for that very attempt, per item."""
    pairs = list(attempts)
    if not pairs:
        return {}
    values = mget(client, [keys.stream_usage(item_id, attempt) for item_id, attempt in pairs])
    kept: dict[int, dict] = {}
    for (item_id, attempt), value in zip(pairs, values, strict=True):
        if value is None:
            continue
        data = json.loads(value)
        if data.get("attempt") == attempt and isinstance(data.get("usage"), dict):
            kept[item_id] = data["usage"]
    return kept


def announce_worker(client: redis.Redis, name: str, queues: Iterable[str], ttl_s: float) -> None:
    """The worker ``name`` is alive and consumes ``queues``, for ``ttl_s`` more."""
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.worker(name), ",".join(queues), px=max(1, int(ttl_s * 1000)))
    pipe.sadd(keys.workers(), name)
    pipe.execute()


def withdraw_worker(client: redis.Redis, name: str) -> None:
    """The worker ``name`` stops: it is gone at once, not when its key expires."""
    pipe = client.pipeline(transaction=False)
    pipe.delete(keys.worker(name))
    pipe.srem(keys.workers(), name)
    pipe.execute()


def live_workers(client: redis.Redis) -> dict[str, list[str]]:
    """Worker name → the queues it consumes, of the workers whose key is live; the
    names of those gone are forgotten on the way."""
    names = sorted(_text(n) for n in client.smembers(keys.workers()))
    if not names:
        return {}
    values = mget(client, [keys.worker(name) for name in names])
    live = {
        name: [q for q in _text(v).split(",") if q]
        for name, v in zip(names, values, strict=True)
        if v is not None
    }
    # A worker of a name forgotten here just as it came back is named again at its
    # next renewal.
    gone = [name for name in names if name not in live]
    if gone:
        client.srem(keys.workers(), *gone)
    return live


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
