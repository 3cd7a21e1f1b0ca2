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

import redis

from batchgen.limits import redis_keys as keys
from batchgen.store import batches
from batchgen.store.db import session_scope

log = logging.getLogger(__name__)

CHANNEL = keys.CANCEL_CHANNEL
POLL_S = 1.0


def announce(client: redis.Redis, batch_id: str) -> None:
    """Tell every worker to stop calls of ``batch_id`` (best effort; the poll backs it up)."""
    try:
        client.publish(CHANNEL, batch_id)
    except redis.RedisError:
        log.warning("could not announce the cancel of %s; workers will poll", batch_id)


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
