"""The simulator's sliding-window limiter: the window guarantee and exact retry-after."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.simulator.limits import SlidingWindowLimiter, max_window_sum


def _brute_max_window(events: list[tuple[float, int]], window_s: float) -> int:
    """Largest sum over windows [ts_i, ts_i + window_s) starting at each event."""
    return max(
        (sum(a for t, a in events if start <= t < start + window_s) for start, _ in events),
        default=0,
    )


steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=30.0, allow_nan=False),  # time advance
        st.integers(min_value=0, max_value=120),  # amount
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(min_value=1, max_value=100),
    window_s=st.floats(min_value=0.5, max_value=60.0, allow_nan=False),
    start=st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    seq=steps,
)
def test_window_guarantee_and_exact_retry_after(
    limit: int, window_s: float, start: float, seq: list[tuple[float, int]]
) -> None:
    limiter = SlidingWindowLimiter(limit, window_s)
    now = start
    admitted: list[tuple[float, int]] = []
    for advance, amount in seq:
        now += advance
        before = copy.deepcopy(limiter)
        result = limiter.try_admit("k", amount, now)
        if result.ok:
            admitted.append((now, amount))
            assert result.retry_after_s == 0
            assert 0 <= result.remaining <= limit
            continue
        assert amount > 0
        if amount > limit:
            assert result.retry_after_s == math.inf
            continue
        retry = result.retry_after_s
        assert 0 < retry <= window_s * (1 + 1e-9) + 1e-9
        # Waiting exactly retry_after is enough (if nothing else is admitted)...
        later = copy.deepcopy(before)
        assert later.try_admit("k", amount, now + retry).ok
        # ...and noticeably less is not.
        if retry > 1e-3:
            sooner = copy.deepcopy(before)
            assert not sooner.try_admit("k", amount, now + retry * 0.999 - 1e-6).ok
    assert _brute_max_window(admitted, window_s) <= limit
    assert max_window_sum(admitted, window_s) == _brute_max_window(admitted, window_s)
    assert limiter.max_window_sum() <= limit
    assert limiter.max_window_sum() == _brute_max_window(admitted, window_s)


@settings(max_examples=200, deadline=None)
@given(
    limit=st.one_of(st.none(), st.integers(min_value=1, max_value=100)),
    window_s=st.floats(min_value=0.5, max_value=60.0, allow_nan=False),
    seq=steps,
)
def test_reset_is_when_the_last_admitted_entry_leaves_the_window(
    limit: int | None, window_s: float, seq: list[tuple[float, int]]
) -> None:
    """``reset_s`` (the provider's reset header) is read in O(1) from the newest entry:
    it equals the latest expiry of the entries still in the window, as a scan finds it."""
    limiter = SlidingWindowLimiter(limit, window_s)
    now = 0.0
    admitted: list[float] = []
    for advance, amount in seq:
        now += advance
        result = limiter.try_admit("k", amount, now)
        if result.ok:
            admitted.append(now)
        in_window = [t + window_s for t in admitted if t + window_s > now]
        expected = (max(in_window) - now) if in_window else 0.0
        assert limiter.check("k", 0, now).reset_s == pytest.approx(expected, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(
    seq=st.lists(
        st.tuples(st.sampled_from("abc"), st.floats(0.0, 20.0), st.integers(1, 40)), max_size=60
    )
)
def test_keys_are_independent(seq: list[tuple[str, float, int]]) -> None:
    limiter = SlidingWindowLimiter(50, 60.0)
    now = 0.0
    per_key: dict[str, list[tuple[float, int]]] = {}
    for key, advance, amount in seq:
        now += advance
        if limiter.try_admit(key, amount, now).ok:
            per_key.setdefault(key, []).append((now, amount))
    for key, events in per_key.items():
        assert max_window_sum(events, 60.0) <= 50
        assert limiter.max_window_sum([key]) == max_window_sum(events, 60.0)
    merged = [e for events in per_key.values() for e in events]
    assert limiter.max_window_sum(list(per_key)) == max_window_sum(merged, 60.0)


def test_window_is_half_open() -> None:
    limiter = SlidingWindowLimiter(10, 60.0)
    assert limiter.try_admit("k", 10, 100.0).ok
    denied = limiter.try_admit("k", 1, 159.999)
    assert not denied.ok and denied.retry_after_s == pytest.approx(0.001)
    assert denied.remaining == 0 and denied.reset_s == pytest.approx(0.001)
    assert limiter.try_admit("k", 10, 160.0).ok


def test_adjust_lowers_the_charge_and_frees_room() -> None:
    limiter = SlidingWindowLimiter(100, 60.0)
    assert limiter.try_admit("k", 80, 0.0, entry_id="r1").ok
    assert not limiter.try_admit("k", 30, 1.0).ok
    limiter.adjust("k", "r1", 50)
    assert limiter.amount_of("r1") == 50
    assert limiter.try_admit("k", 30, 1.0).ok
    with pytest.raises(ValueError):
        limiter.adjust("k", "r1", 60)
    with pytest.raises(KeyError):
        limiter.adjust("other", "r1", 10)
    assert limiter.max_window_sum() == 80  # 50 + 30


def test_unlimited_admits_everything_but_keeps_stats() -> None:
    limiter = SlidingWindowLimiter(None, 60.0)
    for i in range(5):
        assert limiter.try_admit("k", 1000, float(i)).ok
    assert limiter.max_window_sum() == 5000


def test_backwards_clock_cannot_break_the_guarantee() -> None:
    limiter = SlidingWindowLimiter(10, 60.0)
    assert limiter.try_admit("k", 10, 100.0).ok
    assert not limiter.try_admit("k", 1, 50.0).ok  # treated as t=100
    assert limiter.try_admit("k", 10, 160.0).ok


def test_limit_lowered_at_run_time() -> None:
    limiter = SlidingWindowLimiter(100, 10.0)
    assert limiter.try_admit("k", 60, 0.0).ok
    assert limiter.try_admit("k", 30, 1.0).ok
    limiter.limit = 40
    denied = limiter.try_admit("k", 20, 2.0)
    assert not denied.ok and denied.retry_after_s == pytest.approx(9.0)  # both must expire
    assert limiter.try_admit("k", 20, 11.0).ok
