"""One clock for the retries' ETAs across hosts: Redis's.

On a Redis broker a countdown travels as an absolute ETA, and Celery compares it with
the wall clock of whichever host receives it. batchgen sets the ETA from Redis's
clock when it publishes (:class:`batchgen.worker.publish.BatchgenCelery`), and a
worker reads it back in its own frame (:class:`RedisClockRequest`): the ETA plus this
host's offset from Redis (its wall clock less Redis's ``TIME``, measured every
``OFFSET_TTL_S``). A host whose clock runs minutes ahead or behind then neither holds
a retry back nor runs it early (tests/integration/test_multihost.py). RabbitMQ holds a
delayed message for a relative delay itself: nothing to correct there.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

from celery.worker.request import Request

OFFSET_TTL_S = 60.0

_lock = threading.Lock()
_offset_s = 0.0
_measured_at: float | None = None  # monotonic time of the last reading
_measuring = False


def offset_from(local_before_s: float, redis_s: float, local_after_s: float) -> float:
    """This host's wall clock less Redis's, from a reading of Redis's ``TIME`` taken
    between two local readings (the round trip's midpoint): pure."""
    return (local_before_s + local_after_s) / 2 - redis_s


def redis_offset_s() -> float:
    """This host's offset from Redis's clock, as last measured (0 before the first
    reading). Never waits for Redis: it runs in Celery's consumer thread, which must
    keep noticing a lost broker; a reading older than ``OFFSET_TTL_S`` is renewed in
    a thread of its own."""
    global _measuring
    with _lock:
        stale = _measured_at is None or time.monotonic() - _measured_at >= OFFSET_TTL_S
        start = stale and not _measuring
        if start:
            _measuring = True
        offset = _offset_s
    if start:
        threading.Thread(target=_measure, name="redis-clock", daemon=True).start()
    return offset


def _measure() -> None:
    global _offset_s, _measured_at, _measuring
    from batchgen.limits.backend import get_redis

    try:
        before = time.time()
        seconds, micros = get_redis().time()
        offset = offset_from(before, seconds + micros / 1e6, time.time())
    except Exception:  # Redis unreachable: the last offset stays, asked again later
        with _lock:
            _measuring = False
        return
    with _lock:
        _offset_s, _measured_at, _measuring = offset, time.monotonic(), False


def eta_on_redis_clock(countdown_s: float) -> dt.datetime | None:
    """Redis's now plus ``countdown_s`` (None when Redis cannot say)."""
    from batchgen.limits.backend import get_redis

    try:
        seconds, micros = get_redis().time()
    except Exception:
        return None
    return dt.datetime.fromtimestamp(seconds + micros / 1e6 + countdown_s, dt.UTC)


class RedisClockRequest(Request):
    """A task request whose ETA (set on Redis's clock) is read in this host's frame."""

    @property
    def eta(self) -> dt.datetime | None:
        eta = self._eta
        if eta is None or _broker_is_amqp(self.app):
            return eta
        return eta + dt.timedelta(seconds=redis_offset_s())


def _broker_is_amqp(app: Any) -> bool:
    from batchgen.celeryconfig import is_amqp

    return is_amqp(str(app.conf.broker_url))
