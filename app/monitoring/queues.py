"""The broker's side of ``batchgen status``: messages waiting in each queue and the
workers consuming it, and a warning for a queue that has messages but no worker.

Consumers are asked of the workers themselves (Celery's remote control,
``inspect().active_queues()``, as Flower does); queue lengths are read from the
broker (Redis: the list's length; AMQP: a passive declare's message count).
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis
from kombu import Connection

from batchgen.config import Settings
from batchgen.registry import Registry
from batchgen.worker.names import CONTROL_QUEUE
from batchgen.worker.publish import celery_app

INSPECT_TIMEOUT_S = 1.0


def consumers(timeout_s: float = INSPECT_TIMEOUT_S) -> dict[str, list[str]]:
    """Queue name → the workers consuming it (empty when no worker answered)."""
    replies = celery_app.control.inspect(timeout=timeout_s).active_queues() or {}
    by_queue: dict[str, list[str]] = {}
    for worker, queues in sorted(replies.items()):
        for queue in queues or []:
            by_queue.setdefault(queue["name"], []).append(worker)
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
    with contextlib.suppress(Exception), Connection(broker_url) as connection:
        channel = connection.channel()
        for queue in queues:
            with contextlib.suppress(Exception):
                found[queue] = int(channel.queue_declare(queue, passive=True).message_count)
    return found


def queue_view(
    registry: Registry, settings: Settings, timeout_s: float = INSPECT_TIMEOUT_S
) -> dict[str, Any]:
    """Every queue batchgen uses, its messages and consumers, and what to do about a
    queue whose messages nobody consumes."""
    names = [*registry.queues, CONTROL_QUEUE]
    waiting = lengths(settings.broker_url, names)
    served = consumers(timeout_s)
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
