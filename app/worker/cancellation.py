"""Stopping provider calls that are under way when their batch is cancelled.

The database is the truth (a cancelled item is never claimed or sent, see
:func:`batchgen.store.items.claim_sent`); this module only makes calls already sent stop
early. A cancel is announced on a Redis channel; each worker process runs one
watcher thread that sets the cancel event of its in-flight calls for that
batch. Pub/sub loses messages while a subscriber reconnects, so the watcher
also polls PostgreSQL for the batches it has calls in flight for.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import redis
from sqlalchemy.exc import OperationalError

from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import get_redis
from batchgen.store import batches, tenants
from batchgen.store.db import session_scope
from batchgen.store.schema import Tenant

log = logging.getLogger(__name__)

CHANNEL = keys.CANCEL_CHANNEL
POLL_S = 1.0
CANCEL_TRIES = 3


def announce(client: redis.Redis, batch_id: str) -> None:
    """Tell every worker to stop calls of ``batch_id`` (best effort; the poll backs it up)."""
    try:
        client.publish(CHANNEL, batch_id)
    except redis.RedisError:
        log.warning("could not announce the cancel of %s; workers will poll", batch_id)


def cancel_batch(batch_id: str, tenant: str | Tenant) -> dict[str, Any]:
    """Cancel one of ``tenant``'s own batches: items not yet sent end now (a deadlock
    with a concurrent sweep is tried again), then calls under way are told to stop.
    Returns the batch's description."""
    for attempt in range(1, CANCEL_TRIES + 1):
        try:
            with session_scope() as session:
                batch = batches.cancel(session, tenants.find(session, tenant), batch_id)
                described = batches.describe(session, batch)
            break
        except OperationalError:  # a deadlock with a concurrent sweep: PostgreSQL chose us
            if attempt == CANCEL_TRIES:
                raise
    try:  # committed: the answer stands; workers also poll for cancels
        announce(get_redis(), batch_id)
    except Exception as exc:
        log.warning("could not announce a cancel (%s); workers will poll", type(exc).__name__)
    return described


def cancelled_batches_in(batch_ids: list[str]) -> set[str]:
    """Which of ``batch_ids`` have a cancel requested (PostgreSQL)."""
    with session_scope() as session:
        return batches.cancel_requested_among(session, batch_ids)


class CancelWatcher:
    """Per-process registry of in-flight calls, woken by pub/sub or by polling."""

    def __init__(
        self,
        client: redis.Redis,
        poll: Callable[[list[str]], set[str]] = cancelled_batches_in,
        poll_s: float = POLL_S,
    ):
        self.client = client
        self.poll = poll
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._calls: dict[str, set[threading.Event]] = defaultdict(set)
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, batch_id: str) -> Iterator[threading.Event]:
        """An event that is set if ``batch_id`` is cancelled while the block runs."""
        self._ensure_thread()
        event = threading.Event()
        with self._lock:
            self._calls[batch_id].add(event)
        try:
            yield event
        finally:
            with self._lock:
                self._calls[batch_id].discard(event)
                if not self._calls[batch_id]:
                    del self._calls[batch_id]

    def cancel(self, batch_id: str) -> int:
        """Set the events of ``batch_id``'s calls; returns how many."""
        with self._lock:
            events = list(self._calls.get(batch_id, ()))
        for event in events:
            event.set()
        return len(events)

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="cancel-watcher", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        next_poll = time.monotonic() + self.poll_s
        pubsub = None
        while True:
            try:
                if pubsub is None:
                    pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(CHANNEL)
                message = pubsub.get_message(timeout=self.poll_s / 2)
                if message and message.get("type") == "message":
                    data = message["data"]
                    self.cancel(data.decode() if isinstance(data, bytes) else str(data))
            except redis.RedisError:
                pubsub = None
                time.sleep(self.poll_s / 2)
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + self.poll_s
                self._poll_once()

    def _poll_once(self) -> None:
        with self._lock:
            batch_ids = list(self._calls)
        if not batch_ids:
            return
        try:
            for batch_id in self.poll(batch_ids):
                self.cancel(batch_id)
        except Exception:  # a database hiccup must not kill the watcher
            log.exception("cancel poll failed")
