"""A guard for kombu's Redis transport at a lost broker connection.

When the broker connection is lost, Celery's consumer collects the connection (its
transport's ``client`` becomes None) and then closes the channels still around it.
Closing a Redis channel drops its connection pool and then restores its
unacknowledged messages (``QoS.restore_unacked``), which needs a new pool, built from
the collected connection's ``client``: ``AttributeError: 'NoneType' object has no
attribute 'hostname'`` escapes, and the worker ends ("Unrecoverable error"). Issue
#27 saw both workers end so when their Redis was killed.

:func:`install` makes that restore give up quietly when its connection was collected:
the messages stay in Redis's ``unacked`` hash, which the transport restores after the
visibility time-out, and the sweep re-releases every item whose lease runs out from
PostgreSQL anyway. Any other error is raised as before.

The same holds for a message acknowledged (or rejected) after its connection was
collected: a task that ended on its thread while the broker was away is acknowledged
later, from the event loop, on its dead channel (``AttributeError: 'NoneType' object
has no attribute 'client'``, which also ended a worker). That acknowledgement is
dropped: the item's outcome is in PostgreSQL already, and a redelivery of the
message is claimed by nobody.

And a message acknowledged while the broker is away, before the consumer saw it go,
fails in Redis: the error is raised as before, but the delivery leaves the prefetch
count (kombu removes it only after Redis answered). Else a worker whose prefetched
messages all failed so never asked the broker for more, never saw it was lost, and
never reconnected.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import redis
from kombu.transport import redis as redis_transport

log = logging.getLogger(__name__)

_GUARDED = "_batchgen_guarded"


def connection_collected(channel: Any) -> bool:
    """Whether the channel's connection was collected (its transport's client gone)."""
    transport = getattr(channel, "connection", None)
    return transport is None or getattr(transport, "client", None) is None


def install() -> None:
    """Guard ``kombu.transport.redis.QoS``'s ``restore_unacked``, ``ack`` and
    ``reject`` (once per process)."""
    qos = redis_transport.QoS
    original_restore = qos.restore_unacked
    if getattr(original_restore, _GUARDED, False):
        return

    @functools.wraps(original_restore)
    def restore_unacked(self: Any, client: Any = None) -> Any:
        try:
            return original_restore(self, client)
        except AttributeError:
            if not connection_collected(self.channel):
                raise
            log.warning(
                "broker connection lost: %d unacknowledged message(s) left to the "
                "visibility time-out and the sweep",
                len(self._delivered),
            )
            self._delivered.clear()
            return None

    setattr(restore_unacked, _GUARDED, True)
    qos.restore_unacked = restore_unacked  # type: ignore[method-assign]
    qos.ack = _dropped_when_collected(qos.ack, "acknowledgement")  # type: ignore[method-assign]
    qos.reject = _dropped_when_collected(qos.reject, "rejection")  # type: ignore[method-assign]


def _dropped_when_collected(method: Any, what: str) -> Any:
    """``method`` (``QoS.ack`` or ``QoS.reject``), doing nothing on a channel whose
    connection was collected: the delivery belongs to a connection that is gone.

    On a connection that fails under it (the broker lost, not yet seen by the
    consumer), the error is raised as before, but the delivery leaves the prefetch
    count all the same: kombu removes it only after Redis answered, and a worker whose
    every prefetched message failed so would never ask the broker for more, and so
    never see that it was lost (and never reconnect)."""

    @functools.wraps(method)
    def guarded(self: Any, delivery_tag: Any, *args: Any, **kwargs: Any) -> Any:
        if connection_collected(self.channel):
            log.warning("broker connection lost: a message's %s dropped", what)
            self._delivered.pop(delivery_tag, None)
            return None
        try:
            return method(self, delivery_tag, *args, **kwargs)
        except redis.RedisError:
            self._delivered.pop(delivery_tag, None)
            raise

    return guarded
