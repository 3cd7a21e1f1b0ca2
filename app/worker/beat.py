"""Celery beat for batchgen: one schedule at a time, and no beat outliving its dispatcher.

Two rules, each enough to stop duplicate ticks on its own in the common case:

- **One holder.** :class:`LockedScheduler` (``beat_scheduler`` in batchgen.celeryconfig)
  sends due ticks only while it holds the schedule lock, a Redis key with a
  lease of ``BATCHGEN_BEAT_LOCK_LEASE_S`` that the holder renews at every tick
  (at least every third of the lease). Another beat (a second dispatcher, a
  restarted one, ``batchgen beat`` next to an embedded beat) waits and takes
  over when the lease runs out. The key's value names the holder
  (``host:pid:nonce``). Limit: a holder stalled longer than the lease in the
  middle of a send may send that one tick after another beat took over;
  every tick is idempotent.
- **Dies with its parent.** The beat embedded in a dispatcher (``-B``) is a
  child process; :func:`die_with_parent` makes it end when the dispatcher
  ends, even by ``kill -9`` (``PR_SET_PDEATHSIG`` on Linux, and a parent-pid
  watch everywhere), giving the lock back on the way out.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import redis
from celery.beat import PersistentScheduler
from celery.schedules import crontab

from batchgen.config import get_settings
from batchgen.errors import ConfigError
from batchgen.limits.backend import get_redis, script

log = logging.getLogger(__name__)

LOCK_KEY = "batchgen:beat:lock"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_S = 0.5
EXIT_GRACE_S = 5.0


def holder_token() -> str:
    """This process's name in the lock: host, pid (the beat process) and a nonce."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def schedule_holder(client: redis.Redis) -> str | None:
    """The token of the beat holding the schedule now, if any."""
    value = client.get(LOCK_KEY)
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class ScheduleLock:
    """The schedule lock as one beat sees it."""

    client: redis.Redis
    lease_s: float
    token: str = field(default_factory=holder_token)

    @property
    def renew_every_s(self) -> float:
        return self.lease_s / 3

    def hold(self) -> bool:
        """Take the lock if it is free, renew it if it is ours; ``False`` if another holds it."""
        lease_ms = max(1, int(self.lease_s * 1000))
        held = script(self.client, "beat_lock")(keys=[LOCK_KEY], args=[self.token, lease_ms])
        return bool(held)

    def release(self) -> None:
        script(self.client, "beat_unlock")(keys=[LOCK_KEY], args=[self.token])


class LockedScheduler(PersistentScheduler):
    """Celery's persistent scheduler, sending due ticks only while holding the lock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = ScheduleLock(get_redis(), get_settings().worker.beat_lock_lease_s)
        self._holding: bool | None = None  # unknown until the first tick
        super().__init__(*args, **kwargs)

    def _hold(self) -> bool:
        try:
            holding = self._lock.hold()
        except redis.RedisError as exc:
            holding = False
            if self._holding is not False:
                log.warning("beat: cannot reach Redis for the schedule lock; not sending: %s", exc)
        if holding != self._holding:
            if holding:
                log.info("beat: holding the schedule (lease %gs)", self._lock.lease_s)
            else:
                with contextlib.suppress(redis.RedisError):
                    other = schedule_holder(self._lock.client)
                    log.info("beat: another scheduler holds the schedule (%s); waiting", other)
        self._holding = holding
        return holding

    def tick(self, *args: Any, **kwargs: Any) -> float:
        # Celery's tick sends at most one due entry, so the lock is checked before each send.
        if not self._hold():
            return self._lock.renew_every_s
        return float(min(super().tick(*args, **kwargs), self._lock.renew_every_s))

    def close(self) -> None:
        if self._holding:
            with contextlib.suppress(redis.RedisError):
                self._lock.release()
            self._holding = False
        super().close()


def _stop(signum: int, frame: FrameType | None) -> None:
    # Beat's loop turns SystemExit into a clean stop: schedule synced, lock released.
    raise SystemExit(0)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    log.warning("beat: its dispatcher (pid %d) is gone; stopping", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(EXIT_GRACE_S)  # a clean stop that hangs (Redis unreachable) ends here
    os._exit(1)


def die_with_parent() -> None:
    """In an embedded beat process: end when the worker that forked it ends, even by SIGKILL.

    Runs in the beat process's main thread (Celery's ``beat_embedded_init``).
    """
    parent = multiprocessing.parent_process()
    parent_pid = parent.pid if parent is not None and parent.pid else os.getppid()
    signal.signal(signal.SIGTERM, _stop)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            log.warning("beat: prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    threading.Thread(
        target=_watch_parent, args=(parent_pid,), name="beat-parent-watch", daemon=True
    ).start()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def cron_schedule(expression: str) -> crontab:
    """A Celery ``crontab`` from a five-field cron expression (``"0 2 * * *"``)."""
    fields = expression.split()
    if len(fields) != 5:
        raise ConfigError(f"BATCHGEN_NIGHTLY_CRON: {expression!r} is not five cron fields")
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    try:
        return crontab(minute, hour, day_of_week, day_of_month, month_of_year)
    except ValueError as exc:
        raise ConfigError(f"BATCHGEN_NIGHTLY_CRON: {expression!r}: {exc}") from exc
