"""The broker's side of ``batchgen status``: messages waiting in each queue and the
workers consuming it, and a warning for a queue that has messages but no worker.

Consumers are the live workers' own announcements in Redis
(:mod:`batchgen.worker.presence`), read in one round trip; ``batchgen doctor`` asks
the workers themselves (Celery's remote control, ``inspect().active_queues()``, as
Flower does), which waits a second for their replies. Queue lengths are read from the
broker: Redis, the list's length; RabbitMQ, a passive declare's message count. Both
count the messages ready for delivery: not those delivered and unacknowledged, and
on RabbitMQ not the countdowns waiting in its delay queues (``celery_delayed_*``).
A queue the broker does not have (yet) holds no messages.
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis
from kombu import Connection

from batchgen.config import Settings
from batchgen.limits import liveness
from batchgen.registry import Registry
from batchgen.worker.names import CONTROL_QUEUE
from batchgen.worker.publish import celery_app

INSPECT_TIMEOUT_S = 1.0
CONNECT_TIMEOUT_S = 3.0
NOT_FOUND = 404  # AMQP reply code of a passive declare of a missing queue


def consumers(timeout_s: float = INSPECT_TIMEOUT_S) -> dict[str, list[str]]:
    """Queue name → the workers consuming it (empty when no worker answered)."""
    replies = celery_app.control.inspect(timeout=timeout_s).active_queues() or {}
    by_queue: dict[str, list[str]] = {}
    for worker, queues in sorted(replies.items()):
        for queue in queues or []:
            by_queue.setdefault(queue["name"], []).append(worker)
    return by_queue


def announced(client: redis.Redis) -> dict[str, list[str]]:
    """Queue name → the live workers consuming it, as they announce themselves."""
    by_queue: dict[str, list[str]] = {}
    for worker, queues in sorted(liveness.live_workers(client).items()):
        for queue in queues:
            by_queue.setdefault(queue, []).append(worker)
    return by_queue


def lengths(broker_url: str, queues: list[str]) -> dict[str, int | None]:
    """Messages waiting per queue (None: the broker could not say)."""
    found: dict[str, int | None] = dict.fromkeys(queues)
    if broker_url.startswith(("redis://", "rediss://", "unix://")):
        client = redis.Redis.from_url(broker_url)
        with contextlib.suppress(redis.RedisError):
            for queue in queues:
                found[queue] = int(client.llen(queue))
        return found
    with contextlib.suppress(Exception):
        _amqp_lengths(broker_url, queues, found)
    return found


def _amqp_lengths(broker_url: str, queues: list[str], found: dict[str, int | None]) -> None:
    """``queue_declare(passive=True)`` per queue. A queue the broker does not have is
    a 404 that also closes the channel: the next queue gets a new one."""
    with Connection(broker_url, connect_timeout=CONNECT_TIMEOUT_S) as connection:
        connection.ensure_connection(max_retries=1)
        channel: Any = None
        try:
            for queue in queues:
                channel = channel or connection.channel()
                try:
                    found[queue] = int(channel.queue_declare(queue, passive=True).message_count)
                except connection.channel_errors as exc:
                    channel = None  # the broker closed it
                    if getattr(exc, "reply_code", None) == NOT_FOUND:
                        found[queue] = 0
        finally:
            if channel is not None:
                with contextlib.suppress(Exception):
                    channel.close()


def queue_view(registry: Registry, settings: Settings, client: redis.Redis) -> dict[str, Any]:
    """Every queue batchgen uses, its messages and live consumers (``client``: the
    Redis they announce themselves in), and what to do about a queue whose messages
    nobody consumes."""
    names = [*registry.queues, CONTROL_QUEUE]
    waiting = lengths(settings.broker_url, names)
    served = announced(client)
    groups = {spec.queue: spec.group for spec in registry}
    rows, warnings = [], []
    for name in names:
        workers = served.get(name, [])
        rows.append({"queue": name, "messages": waiting[name], "workers": workers})
        if workers or not waiting[name]:
            continue
        start = (
            f"batchgen worker --group {groups[name]}" if name in groups else "batchgen dispatcher"
        )
        warnings.append(
            f"queue {name} has {waiting[name]} messages and no worker consuming it: start `{start}`"
        )
    return {"queues": rows, "warnings": warnings}
