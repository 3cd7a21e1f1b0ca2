"""Waking the packs that wait for a model's slots as soon as slots free, in every process.

A pack whose calls overlap holds a slot per call in flight; denied one, it waits
(:mod:`batchgen.worker.pack_calls`). Within a process, the pack that frees slots wakes
as many of the process's waiting packs (:meth:`SlotWakeups.freed`). The others are
told through Redis: the settle round trip that frees the slots also publishes the model
and how many (:meth:`SlotWakeups.announcement`, one more command in that round trip),
and a process whose packs have waited listens (one thread, one connection, started by
its first wait) and wakes as many of its own. A message lost (a subscriber
reconnecting, a failover) costs only the wait until the pack's next poll
(``SLOT_POLL_S``), as before there was any message: the slots themselves are only
ever taken by the gate's script.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator

import redis

from batchgen.limits import redis_keys as keys

log = logging.getLogger(__name__)

CHANNEL = keys.SLOTS_FREED_CHANNEL
# How long the listener waits for a message before it looks again (and how long it
# waits before subscribing again after a Redis error).
LISTEN_S = 1.0


class SlotWakeups:
    """The process's packs waiting for a model's slots, woken as slots free here or in
    another process."""

    def __init__(self) -> None:
        self._after_fork()
        os.register_at_fork(after_in_child=self._after_fork)
        self._listening_to: redis.Redis | None = None  # the Redis its listener is on
        self._listener_pid = 0
        self._refused = False  # Redis refused the subscription once (said in the log)

    def _after_fork(self) -> None:
        """A process's own state: a child starts with none of its parent's waiters, lock
        or origin."""
        self._lock = threading.Lock()
        self._waiting: dict[str, list[threading.Event]] = {}  # by model, first come first
        # This process's own announcements come back to it: its waiters heard them first.
        self._origin = secrets.token_hex(8)

    @contextlib.contextmanager
    def waiting(
        self, model: str, wake: threading.Event, client: redis.Redis | None = None
    ) -> Iterator[None]:
        """Meanwhile, ``wake`` is set when ``model``'s slots are freed here (or, given
        ``client``, in a process whose announcement its Redis carries): once, if it is
        among the first waiters, as many as slots freed."""
        if client is not None:
            self._listen(client)
        with self._lock:
            self._waiting.setdefault(model, []).append(wake)
        try:
            yield
        finally:
            with self._lock:
                waiters = self._waiting.get(model, [])
                if wake in waiters:
                    waiters.remove(wake)

    def wait(self, model: str, timeout_s: float, client: redis.Redis | None = None) -> None:
        """Until ``model``'s slots are freed (see :meth:`waiting`), at most ``timeout_s``."""
        wake = threading.Event()
        with self.waiting(model, wake, client):
            wake.wait(timeout_s)

    def waiters(self, model: str) -> int:
        """How many wait for ``model``'s slots here."""
        with self._lock:
            return len(self._waiting.get(model, ()))

    def freed(self, model: str, slots: int) -> None:
        """``slots`` of ``model``'s slots were freed: wake as many waiting packs here."""
        if slots <= 0:
            return
        with self._lock:
            waiters = self._waiting.get(model, [])
            woken, waiters[:] = waiters[:slots], waiters[slots:]
        for wake in woken:
            wake.set()

    def announcement(self, model: str, slots: int) -> tuple[str, str, str]:
        """The command that tells the other processes (a PUBLISH, for the pipeline that
        frees the slots)."""
        return ("PUBLISH", CHANNEL, f"{slots} {self._origin} {model}")

    def heard(self, message: bytes | str) -> None:
        """An announcement another process published: wake as many waiting packs here.
        One that is not of this form is ignored."""
        text = message.decode(errors="replace") if isinstance(message, bytes) else message
        count, origin, model = (text.split(" ", 2) + ["", ""])[:3]
        if origin == self._origin or not model or not (count.isascii() and count.isdigit()):
            return
        self.freed(model, int(count))

    def _listen(self, client: redis.Redis) -> None:
        """Start the process's listener on ``client``'s Redis, once (again in a forked
        child; a listener on another client, which the process no longer uses, ends)."""
        if self._listening_to is client and self._listener_pid == os.getpid():
            return
        with self._lock:
            if self._listening_to is client and self._listener_pid == os.getpid():
                return
            self._listening_to, self._listener_pid = client, os.getpid()
            threading.Thread(
                target=self._run, args=(client,), name="batchgen-slot-wakeups", daemon=True
            ).start()

    def _run(self, client: redis.Redis) -> None:
        pubsub = None
        while self._listening_to is client and self._listener_pid == os.getpid():
            try:
                if pubsub is None:
                    pubsub = client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(CHANNEL)
                message = pubsub.get_message(timeout=LISTEN_S)
                if message and message.get("type") == "message":
                    self.heard(message["data"])
            except Exception as exc:  # the poll stands in meanwhile; the thread goes on
                if not isinstance(exc, redis.RedisError):
                    log.exception("slot wake-ups: subscribing again")
                elif isinstance(exc, redis.ResponseError) and not self._refused:
                    self._refused = True  # NOPERM, say: the packs poll instead
                    log.warning("slot wake-ups: Redis refused the subscription (%s)", exc)
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
                pubsub = None
                time.sleep(LISTEN_S)
        if pubsub is not None:
            with contextlib.suppress(Exception):
                pubsub.close()


WAKEUPS = SlotWakeups()
