"""An exact sliding-window limiter (pure: no I/O, the caller passes the clock).

Each admitted request is an entry ``(ts, amount)`` of its key. An entry is
*active* at time ``t`` when ``ts <= t < ts + window_s``. A request of
``amount`` at ``now`` is admitted iff the active sum plus ``amount`` is at most
``limit``. Because every window ``[t, t + window_s)`` holding some entries is
covered by the active set at the time of its latest entry, this gives the
guarantee: **the admitted sum in any window of ``window_s`` seconds is at most
``limit``** (per key). ``adjust`` may only lower an entry, which keeps it.

Times must not go backwards per key; an earlier ``now`` is treated as the
latest time seen (so a non-monotonic clock cannot break the guarantee).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from typing import NamedTuple


class Admission(NamedTuple):
    """Result of :meth:`SlidingWindowLimiter.try_admit`.

    ``retry_after_s``: 0 if admitted; else the wait after which the same
    request would be admitted if nothing else is admitted meanwhile
    (``math.inf`` if ``amount > limit``). ``remaining``: what is left in the
    window after this decision. ``reset_s``: time until the window is empty.
    """

    ok: bool
    retry_after_s: float
    remaining: int
    reset_s: float


class _Entry:
    __slots__ = ("ts", "expiry", "amount", "entry_id", "key")

    def __init__(self, key: Hashable, ts: float, expiry: float, amount: int, entry_id: Hashable):
        self.key = key
        self.ts = ts
        self.expiry = expiry
        self.amount = amount
        self.entry_id = entry_id


class _Bucket:
    __slots__ = ("active", "total", "last_now")

    def __init__(self) -> None:
        self.active: deque[_Entry] = deque()
        self.total = 0
        self.last_now = -math.inf


def max_window_sum(events: Iterable[tuple[float, int]], window_s: float) -> int:
    """Largest sum of amounts of ``(ts, amount)`` events within any ``[t, t + window_s)``."""
    ordered = sorted(events, key=lambda e: e[0])
    best = current = 0
    start = 0
    for ts, amount in ordered:
        current += amount
        while ordered[start][0] + window_s <= ts:
            current -= ordered[start][1]
            start += 1
        best = max(best, current)
    return best


class SlidingWindowLimiter:
    """Per-key exact sliding log: at most ``limit`` units in any ``window_s`` seconds.

    ``limit=None`` admits everything (still recorded for :meth:`max_window_sum`).
    The last ``history_size`` admitted entries are kept for statistics.
    """

    def __init__(self, limit: int | None, window_s: float, history_size: int = 100_000) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.limit = limit
        self.window_s = window_s
        self._buckets: dict[Hashable, _Bucket] = {}
        self._history: deque[_Entry] = deque(maxlen=history_size)
        self._by_id: dict[Hashable, _Entry] = {}
        self._next_id = 0

    def _bucket(self, key: Hashable, now: float) -> tuple[_Bucket, float]:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        now = max(now, bucket.last_now)
        bucket.last_now = now
        active = bucket.active
        while active and active[0].expiry <= now:
            bucket.total -= active.popleft().amount
        return bucket, now

    def _retry_after(self, bucket: _Bucket, amount: int, now: float) -> float:
        assert self.limit is not None
        if amount > self.limit:
            return math.inf
        excess = bucket.total + amount - self.limit
        for entry in bucket.active:  # oldest first: they expire in order
            excess -= entry.amount
            if excess <= 0:
                wait = entry.expiry - now
                while now + wait < entry.expiry:  # make now + wait land on/after expiry
                    wait = math.nextafter(wait, math.inf)
                return wait
        return math.inf  # unreachable while amount <= limit

    def _reset(self, bucket: _Bucket, now: float) -> float:
        # Entries are appended in time order with one window each (an adjustment
        # changes amounts only), so the newest expires last: O(1), not a scan.
        return (bucket.active[-1].expiry if bucket.active else now) - now

    def check(self, key: Hashable, amount: int, now: float) -> Admission:
        """Would ``amount`` be admitted for ``key`` at ``now``? Records nothing."""
        bucket, now = self._bucket(key, now)
        if self.limit is None:
            return Admission(True, 0.0, 0, self._reset(bucket, now))
        if bucket.total + amount <= self.limit:
            return Admission(
                True, 0.0, self.limit - bucket.total - amount, self._reset(bucket, now)
            )
        retry = self._retry_after(bucket, amount, now)
        return Admission(False, retry, max(0, self.limit - bucket.total), self._reset(bucket, now))

    def try_admit(
        self, key: Hashable, amount: int, now: float, entry_id: Hashable | None = None
    ) -> Admission:
        """Admit ``amount`` for ``key`` at ``now`` if it fits; record it under ``entry_id``.

        ``entry_id`` (default: a fresh integer) names the entry for :meth:`adjust`.
        """
        if amount < 0:
            raise ValueError("amount must be >= 0")
        result = self.check(key, amount, now)
        if result.ok:
            bucket = self._buckets[key]
            ts = bucket.last_now
            if entry_id is None:
                entry_id = ("auto", self._next_id)
                self._next_id += 1
            entry = _Entry(key, ts, ts + self.window_s, amount, entry_id)
            bucket.active.append(entry)
            bucket.total += amount
            if len(self._history) == self._history.maxlen:
                self._by_id.pop(self._history[0].entry_id, None)
            self._history.append(entry)
            self._by_id[entry_id] = entry
            result = result._replace(reset_s=entry.expiry - ts)
        return result

    def adjust(self, key: Hashable, entry_id: Hashable, new_amount: int) -> None:
        """Lower the amount of an admitted entry (``charge_mode="actual"``).

        Raises ``KeyError`` for an unknown entry and ``ValueError`` for an increase
        (that could break the window guarantee).
        """
        entry = self._by_id[entry_id]
        if entry.key != key:
            raise KeyError(entry_id)
        if new_amount > entry.amount or new_amount < 0:
            raise ValueError(f"adjust may only lower an entry ({entry.amount} -> {new_amount})")
        bucket = self._buckets.get(key)
        if bucket is not None and entry.expiry > bucket.last_now:
            bucket.total -= entry.amount - new_amount  # still active
        entry.amount = new_amount

    def amount_of(self, entry_id: Hashable) -> int:
        """Current amount of an entry still in the history."""
        return self._by_id[entry_id].amount

    def known_keys(self) -> list[Hashable]:
        """Keys with any recorded history."""
        return list({e.key: None for e in self._history})

    def max_window_sum(self, keys: Iterable[Hashable] | None = None) -> int:
        """Largest admitted sum in any window, from the retained history.

        ``keys=None``: the maximum over single keys (what the limit bounds).
        Otherwise the entries of all ``keys`` are merged into one log.
        """
        if keys is None:
            per_key: dict[Hashable, list[tuple[float, int]]] = {}
            for e in self._history:
                per_key.setdefault(e.key, []).append((e.ts, e.amount))
            return max((max_window_sum(ev, self.window_s) for ev in per_key.values()), default=0)
        wanted = set(keys)
        return max_window_sum(
            ((e.ts, e.amount) for e in self._history if e.key in wanted), self.window_s
        )

    def clear(self) -> None:
        """Forget all entries and history."""
        self._buckets.clear()
        self._history.clear()
        self._by_id.clear()
