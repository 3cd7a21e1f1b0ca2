"""A token-bucket limiter, like OpenAI's (pure: no I/O, the caller passes the clock).

Per key, a bucket of ``capacity = limit`` units starts full and refills
continuously at ``rate = limit / window_s`` units per second, never above its
capacity. A request of ``amount`` at ``now`` is admitted iff the bucket holds
at least ``amount``; admitting it takes ``amount`` out. The level never drops
below zero, so this gives the guarantee: **for any ``t0 <= t1``, the amount
admitted at times in ``[t0, t1]`` is at most ``capacity + rate * (t1 - t0)``**
(per key).

The arithmetic is exact (:class:`fractions.Fraction` of the float times the
caller passes), so the guarantee holds without rounding slack and
``retry_after_s`` is exact: the smallest wait ``w`` (a float) such that the
same request at ``now + w`` is admitted if nothing else is admitted meanwhile;
any earlier time is refused.

Times must not go backwards per key; an earlier ``now`` is treated as the
latest time seen (so a non-monotonic clock cannot break the guarantee). Charges
are final: a bucket has no :meth:`adjust` (a refund into a bucket could let a
later burst exceed the guarantee).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from fractions import Fraction

from batchgen.simulator.limits import Admission, max_window_sum


def own_count_charge(body_bytes: int, max_tokens: int) -> int:
    """What the simulator charges in bucket mode: ``ceil(body_bytes / 4) + max_tokens``.

    The provider counts in its own way (about four bytes a token for the whole
    request body), not with the client's tokenizer.
    """
    if body_bytes < 0 or max_tokens < 0:
        raise ValueError("body_bytes and max_tokens must be >= 0")
    return -(-body_bytes // 4) + max_tokens


def max_burst(events: Iterable[tuple[float, int]], rate: float) -> float:
    """``max over t0 <= t1`` of (the amounts of ``(ts, amount)`` events at times in
    ``[t0, t1]``) ``- rate * (t1 - t0)``: at most the capacity for a bucket of ``rate``.

    0 for no events. O(n log n).
    """
    ordered = sorted(events, key=lambda e: e[0])
    if not ordered:
        return 0.0
    origin = ordered[0][0]  # small times keep the float error small
    best = 0.0
    prefix = 0.0  # sum of amounts before event j
    best_start = -math.inf  # max over i <= j of (rate * t_i - prefix before i)
    for ts, amount in ordered:
        t = ts - origin
        best_start = max(best_start, rate * t - prefix)
        prefix += amount
        best = max(best, prefix - rate * t + best_start)
    return best


class _Bucket:
    __slots__ = ("level", "last", "last_float")

    def __init__(self, level: Fraction, last: Fraction, last_float: float) -> None:
        self.level = level
        self.last = last
        self.last_float = last_float


class TokenBucketLimiter:
    """Per-key token bucket: capacity ``limit``, refilled at ``limit / window_s`` per second.

    ``limit=None`` admits everything (still recorded for the statistics). The
    last ``history_size`` admitted ``(ts, amount)`` entries are kept for
    :meth:`max_burst` and :meth:`max_window_sum`. ``limit`` may be changed at
    run time: levels are capped at the new capacity and refill at the new rate.
    """

    def __init__(self, limit: int | None, window_s: float, history_size: int = 100_000) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.limit = limit
        self.window_s = window_s
        self._window = Fraction(window_s)
        self._buckets: dict[Hashable, _Bucket] = {}
        self._history: deque[tuple[Hashable, float, int, Hashable]] = deque(maxlen=history_size)
        self._by_id: dict[Hashable, int] = {}
        self._next_id = 0

    # -- the bucket ------------------------------------------------------------
    @property
    def rate(self) -> float | None:
        """Refill in units per second (``None`` when unlimited)."""
        return None if self.limit is None else self.limit / self.window_s

    def _rate(self) -> Fraction:
        assert self.limit is not None
        return Fraction(self.limit) / self._window

    def _bucket(self, key: Hashable, now: float) -> tuple[_Bucket, float]:
        """The bucket of ``key`` refilled up to ``now`` (a new key starts full)."""
        assert self.limit is not None
        capacity = Fraction(self.limit)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(capacity, Fraction(now), now)
            return bucket, now
        if now <= bucket.last_float:
            now = bucket.last_float
        else:
            t = Fraction(now)
            bucket.level = min(capacity, bucket.level + self._rate() * (t - bucket.last))
            bucket.last, bucket.last_float = t, now
        bucket.level = min(capacity, bucket.level)  # the limit may have been lowered
        return bucket, now

    def _retry_after(self, bucket: _Bucket, amount: int, now: float) -> float:
        """The smallest float ``w > 0`` with ``level(now + w) >= amount`` (float addition)."""
        target = bucket.last + (amount - bucket.level) / self._rate()  # exact time it fits
        at = float(target)  # the first float time at or after target
        if Fraction(at) < target:
            at = math.nextafter(at, math.inf)
        wait = at - now  # exact when at <= 2 * now (Sterbenz); else a little off
        for _ in range(64):  # make now + wait reach target (a step or two at most)
            if Fraction(now + wait) >= target:
                break
            wait = math.nextafter(wait, math.inf)
        for _ in range(64):  # and not overshoot it
            lower = math.nextafter(wait, -math.inf)
            if lower <= 0 or Fraction(now + lower) < target:
                break
            wait = lower
        return wait

    def _reset(self, level: Fraction) -> float:
        """Seconds until a bucket at ``level`` is full again."""
        assert self.limit is not None
        return float((self.limit - level) / self._rate())

    def check(self, key: Hashable, amount: int, now: float) -> Admission:
        """Would ``amount`` be admitted for ``key`` at ``now``? Records nothing.

        ``remaining`` and ``reset_s`` describe the bucket as it would be after
        admitting (when admitted), else as it is.
        """
        if self.limit is None:
            return Admission(True, 0.0, 0, 0.0)
        bucket, now = self._bucket(key, now)
        if amount <= bucket.level:
            after = bucket.level - amount
            return Admission(True, 0.0, math.floor(after), self._reset(after))
        retry = math.inf if amount > self.limit else self._retry_after(bucket, amount, now)
        return Admission(False, retry, math.floor(bucket.level), self._reset(bucket.level))

    def try_admit(
        self, key: Hashable, amount: int, now: float, entry_id: Hashable | None = None
    ) -> Admission:
        """Admit ``amount`` for ``key`` at ``now`` if it fits; record it under ``entry_id``."""
        if amount < 0:
            raise ValueError("amount must be >= 0")
        result = self.check(key, amount, now)
        if not result.ok:
            return result
        ts = now
        if self.limit is not None:
            bucket = self._buckets[key]
            bucket.level -= amount
            ts = bucket.last_float
        if entry_id is None:
            entry_id = ("auto", self._next_id)
            self._next_id += 1
        if len(self._history) == self._history.maxlen:
            self._by_id.pop(self._history[0][3], None)
        self._history.append((key, ts, amount, entry_id))
        self._by_id[entry_id] = amount
        return result

    # -- statistics ------------------------------------------------------------
    def amount_of(self, entry_id: Hashable) -> int:
        """The charge of an entry still in the history."""
        return self._by_id[entry_id]

    def known_keys(self) -> list[Hashable]:
        """Keys with any recorded history."""
        return list({e[0]: None for e in self._history})

    def _events(self, keys: Iterable[Hashable] | None) -> list[list[tuple[float, int]]]:
        """The retained ``(ts, amount)`` events: one list per key, or one merged list."""
        if keys is None:
            per_key: dict[Hashable, list[tuple[float, int]]] = {}
            for key, ts, amount, _ in self._history:
                per_key.setdefault(key, []).append((ts, amount))
            return list(per_key.values())
        wanted = set(keys)
        return [[(ts, amount) for key, ts, amount, _ in self._history if key in wanted]]

    def max_window_sum(self, keys: Iterable[Hashable] | None = None) -> int:
        """Largest admitted sum in any ``[t, t + window_s)``, from the retained history.

        A bucket bounds it by ``2 * limit`` (a full bucket plus one window of refill).
        ``keys=None``: the maximum over single keys, else the entries of ``keys`` merged.
        """
        return max((max_window_sum(ev, self.window_s) for ev in self._events(keys)), default=0)

    def max_burst(self, keys: Iterable[Hashable] | None = None) -> float | None:
        """:func:`max_burst` of the retained history at the current rate (``None`` if
        unlimited): at most ``limit`` while the limit was not changed."""
        rate = self.rate
        if rate is None:
            return None
        return max((max_burst(ev, rate) for ev in self._events(keys)), default=0.0)

    def total(self) -> int:
        """The sum of the retained admitted amounts (all keys)."""
        return sum(e[2] for e in self._history)

    def clear(self) -> None:
        """Forget all buckets (they start full again) and history."""
        self._buckets.clear()
        self._history.clear()
        self._by_id.clear()
