"""A worker's heartbeat for the items whose calls it has in flight.

An item is claimed with a running lease in PostgreSQL; a call that is paid must not
be handed to another worker while its owner still lives, also when PostgreSQL is
unreachable for longer than the lease. So while a worker holds an item (from its
claim to its recording, :meth:`Heartbeat.hold`), two threads of the process renew it
every ``BATCHGEN_HEARTBEAT_INTERVAL_S`` (at most a third of the lease):

- in PostgreSQL, its lease (one statement for every item held:
  :func:`batchgen.store.items.renew_leases`);
- in Redis, a key naming its attempt that expires a lease after the renewal
  (:mod:`batchgen.limits.liveness`). The sweep leaves alone a running item whose
  key is live (:func:`batchgen.worker.sweep.sweep`): when PostgreSQL comes back
  after a long outage its lease has run out, but its owner is there to record it.

Each renewal that succeeds extends how long the worker keeps trying to record the
item's outcome (:meth:`Heartbeat.lease_left_s`, used by
:func:`batchgen.worker.recording.with_db_retries`). A worker that dies stops
renewing: its keys expire and its leases run out one lease after the last renewal,
and the sweep takes its items back as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from batchgen.config import Settings, get_settings
from batchgen.limits import liveness
from batchgen.limits.backend import get_redis
from batchgen.store import db, items
from batchgen.store.items import Claimed

log = logging.getLogger(__name__)

# A renewal is never further apart than this share of the lease it renews.
MIN_RENEWALS_PER_LEASE = 3
# The shortest wait between renewals, and the wait while no interval could be read.
MIN_INTERVAL_S = 0.05


@dataclass
class _Held:
    item_id: int
    attempt: int
    lease_s: float
    owned_until_mono_s: float  # the latest end of a lease renewed (monotonic clock)
    keyed: bool = False  # its Redis key was set


class Heartbeat:
    """The process's items in flight, renewed by two daemon threads (started at the
    first :meth:`hold`)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()
        self._started = False
        self._stop = threading.Event()

    @property
    def settings(self) -> Settings:
        return self._settings or get_settings()

    @contextmanager
    def hold(self, item: Claimed, lease_s: float) -> Iterator[None]:
        """Keep ``item`` (claimed with a lease of ``lease_s``) renewed inside the block."""
        held = _Held(item.item_id, item.attempt, lease_s, time.monotonic() + item.lease_left_s())
        with self._lock:
            self._held[item.item_id] = held
            self._start()
        try:
            yield
        finally:
            with self._lock:
                gone = self._held.pop(item.item_id, None)
            if gone is not None and gone.keyed:
                try:
                    liveness.drop(get_redis(), item.item_id)
                except Exception:  # noqa: BLE001 - the key expires by itself
                    log.debug("item %d: could not drop its heartbeat key", item.item_id)

    def lease_left_s(self, item: Claimed) -> float:
        """Seconds the item stays ours: its claimed lease, or the last renewal's."""
        left_s = item.lease_left_s()
        with self._lock:
            held = self._held.get(item.item_id)
        if held is None or held.attempt != item.attempt:
            return left_s
        return max(left_s, held.owned_until_mono_s - time.monotonic())

    def interval_s(self) -> float:
        with self._lock:
            shortest = min((h.lease_s for h in self._held.values()), default=None)
        interval = self.settings.worker.heartbeat_interval_s
        if shortest is not None:
            interval = min(interval, shortest / MIN_RENEWALS_PER_LEASE)
        return max(MIN_INTERVAL_S, interval)

    def renew_in_redis(self) -> None:
        """One renewal of every held item's key (one round trip)."""
        held = self._snapshot()
        if not held:
            return
        started = time.monotonic()
        liveness.renew(get_redis(), [(h.item_id, h.attempt, h.lease_s) for h in held])
        self._renewed(held, started, keyed=True)

    def renew_in_postgres(self) -> None:
        """One renewal of every held item's lease (one statement per lease length)."""
        held = self._snapshot()
        by_lease: dict[float, list[_Held]] = {}
        for h in held:
            by_lease.setdefault(h.lease_s, []).append(h)
        for lease_s, group in by_lease.items():
            started = time.monotonic()  # before the statement whose now() the lease counts from
            with db.autocommit() as connection:
                items.renew_leases(connection, [(h.item_id, h.attempt) for h in group], lease_s)
            self._renewed(group, started)

    def stop(self) -> None:
        self._stop.set()

    def _snapshot(self) -> list[_Held]:
        with self._lock:
            return list(self._held.values())

    def _renewed(self, held: list[_Held], started_mono_s: float, keyed: bool = False) -> None:
        with self._lock:
            for h in held:
                if self._held.get(h.item_id) is h:
                    h.owned_until_mono_s = max(h.owned_until_mono_s, started_mono_s + h.lease_s)
                    if keyed:
                        h.keyed = True

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        for name, renew in (("redis", self.renew_in_redis), ("postgres", self.renew_in_postgres)):
            thread = threading.Thread(
                target=self._loop, args=(name, renew), name=f"heartbeat-{name}", daemon=True
            )
            thread.start()

    def _loop(self, name: str, renew: Callable[[], None]) -> None:
        failing = False
        wait_s = MIN_INTERVAL_S
        while True:
            try:
                wait_s = self.interval_s()
            except Exception:  # noqa: BLE001 - settings unreadable a moment: the last wait
                log.debug("heartbeat: interval unreadable, %.2f s kept", wait_s, exc_info=True)
            if self._stop.wait(wait_s):
                return
            try:
                renew()
            except Exception as exc:  # noqa: BLE001 - an outage: the next beat tries again
                if not failing:
                    log.warning("heartbeat: renewal in %s failed (%s)", name, type(exc).__name__)
                failing = True
            else:
                if failing:
                    log.info("heartbeat: renewal in %s works again", name)
                failing = False


_heartbeat = Heartbeat()


def heartbeat() -> Heartbeat:
    """The process's heartbeat."""
    return _heartbeat
