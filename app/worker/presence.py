"""A worker process's presence in Redis: its name and the queues it consumes, renewed
every ``BATCHGEN_HEARTBEAT_INTERVAL_S`` by a daemon thread from the moment it is ready
(:mod:`batchgen.limits.liveness`), withdrawn when it shuts down. The status view reads
the live workers from there instead of asking them with a Celery broadcast, which
waits its whole timeout for replies on every request. A killed worker is gone once
its key expires, a few renewals after the last.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import redis

from batchgen.config import get_settings
from batchgen.limits import liveness
from batchgen.limits.backend import get_redis

log = logging.getLogger(__name__)

# A worker's key outlives this many renewals: one missed renewal does not hide it.
RENEWALS_PER_TTL = 3


class Presence:
    """The process's announcement, renewed by one daemon thread between
    :meth:`start` and :meth:`stop`."""

    def __init__(self, name: str, queues: Callable[[], list[str]]) -> None:
        self.name = name
        self._queues = queues  # what it consumes now (a remote control may change it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchgen-presence", daemon=True)

    def start(self) -> Presence:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        # A renewal under way must not name the worker again after it is withdrawn.
        self._thread.join(get_settings().redis.socket_timeout_s)
        with contextlib.suppress(redis.RedisError):  # else its key expires by itself
            liveness.withdraw_worker(get_redis(), self.name)

    def _run(self) -> None:
        interval_s = get_settings().worker.heartbeat_interval_s
        while not self._stop.is_set():
            try:
                liveness.announce_worker(
                    get_redis(), self.name, self._queues(), RENEWALS_PER_TTL * interval_s
                )
            except redis.RedisError as exc:  # Redis away: the next renewal tries again
                log.warning("presence: not renewed (%s)", type(exc).__name__)
            self._stop.wait(interval_s)


def consumed_queues(consumer: object, fallback: list[str]) -> Callable[[], list[str]]:
    """The queues Celery's ``consumer`` consumes at each call (``fallback`` while it
    has no task consumer: between a lost broker connection and the next)."""

    def now() -> list[str]:
        task_consumer = getattr(consumer, "task_consumer", None)
        queues = getattr(task_consumer, "queues", None)
        return sorted(q.name for q in queues) if queues else fallback

    return now
