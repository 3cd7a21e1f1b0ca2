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
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from kombu.transport import redis as redis_transport

log = logging.getLogger(__name__)

_GUARDED = "_batchgen_guarded"


def connection_collected(channel: Any) -> bool:
    """Whether the channel's connection was collected (its transport's client gone)."""
    transport = getattr(channel, "connection", None)
    return transport is None or getattr(transport, "client", None) is None


def install() -> None:
    """Guard ``kombu.transport.redis.QoS.restore_unacked`` (once per process)."""
    original = redis_transport.QoS.restore_unacked
    if getattr(original, _GUARDED, False):
        return

    @functools.wraps(original)
    def restore_unacked(self: Any, client: Any = None) -> Any:
        try:
            return original(self, client)
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
    redis_transport.QoS.restore_unacked = restore_unacked  # type: ignore[method-assign]
