"""The simulator's token-bucket limiter: the bucket guarantee, exact retry-after, own count."""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.simulator.__main__ import build_parser, config_from_args
from batchgen.simulator.bucket import TokenBucketLimiter, max_burst, own_count_charge
from batchgen.simulator.limits import SlidingWindowLimiter
from batchgen.simulator.sim_config import SimulatorConfig
from batchgen.simulator.state import SimState


def _brute_max_burst(events: list[tuple[Fraction, int]], rate: Fraction) -> Fraction:
    """max over event times t0 <= t1 of (admitted in [t0, t1]) - rate * (t1 - t0), exactly."""
    ordered = sorted(events)
    best = Fraction(0)
    for i, (t0, _) in enumerate(ordered):
        first = next(k for k, (t, _) in enumerate(ordered) if t == t0)  # ties all count
        total = sum(a for _, a in ordered[first:i])
        for t1, amount in ordered[i:]:
            total += amount
            best = max(best, total - rate * (t1 - t0))
    return best


steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=30.0, allow_nan=False),  # time advance
        st.integers(min_value=0, max_value=250),  # amount
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=250, deadline=None)
@given(
    limit=st.integers(min_value=1, max_value=200),
    window_s=st.floats(min_value=0.5, max_value=60.0, allow_nan=False),
    start=st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    seq=steps,
)
def test_bucket_guarantee_and_exact_retry_after(
    limit: int, window_s: float, start: float, seq: list[tuple[float, int]]
) -> None:
    limiter = TokenBucketLimiter(limit, window_s)
    rate = Fraction(limit) / Fraction(window_s)
    now = start
    admitted: list[tuple[Fraction, int]] = []
    for advance, amount in seq:
        now += advance
        before = copy.deepcopy(limiter)
        result = limiter.try_admit("k", amount, now)
        if result.ok:
            admitted.append((Fraction(now), amount))
            assert result.retry_after_s == 0
            assert 0 <= result.remaining <= limit - amount
            assert 0 <= result.reset_s <= window_s * (1 + 1e-9)
            continue
        assert amount > 0
        assert 0 <= result.remaining < amount
        if amount > limit:
            assert result.retry_after_s == math.inf
            continue
        retry = result.retry_after_s
        assert 0 < retry <= window_s * amount / limit * (1 + 1e-9) + 1e-9
        # Waiting exactly retry_after is enough (if nothing else is admitted)...
        assert copy.deepcopy(before).try_admit("k", amount, now + retry).ok
        # ...and a microsecond less is not (not the float just before now + retry: the
        # sum rounds, and several waits can land on the same float time).
        assert not copy.deepcopy(before).try_admit("k", amount, now + retry - 1e-6).ok
    # The guarantee, exactly: admitted in [t0, t1] <= capacity + rate * (t1 - t0).
    brute = _brute_max_burst(admitted, rate)
    assert brute <= limit
    burst = limiter.max_burst()
    assert burst is not None and burst <= limit + 1e-6
    assert burst == pytest.approx(float(brute), abs=1e-6)
    assert max_burst([(float(t), a) for t, a in admitted], float(rate)) == burst
    assert limiter.total() == sum(a for _, a in admitted)
    assert limiter.max_window_sum() <= 2 * limit


@settings(max_examples=100, deadline=None)
@given(
    seq=st.lists(
        st.tuples(st.sampled_from("abc"), st.floats(0.0, 5.0), st.integers(1, 40)), max_size=60
    )
)
def test_keys_are_independent(seq: list[tuple[str, float, int]]) -> None:
    limiter = TokenBucketLimiter(50, 60.0)
    alone = {key: TokenBucketLimiter(50, 60.0) for key in "abc"}
    now = 0.0
    for key, advance, amount in seq:
        now += advance
        assert limiter.try_admit(key, amount, now).ok == alone[key].try_admit(key, amount, now).ok
    for key, single in alone.items():
        assert limiter.max_burst([key]) == single.max_burst()
        assert limiter.max_window_sum([key]) == single.max_window_sum()


def test_starts_full_and_refills_continuously() -> None:
    limiter = TokenBucketLimiter(600, 60.0)  # 10 per second
    first = limiter.try_admit("k", 400, 1000.0)
    assert first.ok and first.remaining == 200 and first.reset_s == pytest.approx(40.0)
    denied = limiter.try_admit("k", 300, 1000.0)
    assert not denied.ok and denied.remaining == 200
    assert denied.retry_after_s == pytest.approx(10.0) and denied.reset_s == pytest.approx(40.0)
    assert not limiter.try_admit("k", 300, 1009.999).ok
    assert limiter.try_admit("k", 300, 1010.0).ok  # 200 + 10 s * 10 = 300, all of it
    assert limiter.check("k", 0, 1010.0).remaining == 0
    # Never above capacity, however long it waits.
    peek = limiter.check("k", 0, 5000.0)
    assert peek.ok and peek.remaining == 600 and peek.reset_s == 0
    assert limiter.try_admit("k", 600, 5000.0).ok
    assert not limiter.try_admit("k", 1, 5000.0).ok
    assert limiter.try_admit("k", 601, 9000.0).retry_after_s == math.inf


def test_requests_bucket_of_one_per_second() -> None:
    limiter = TokenBucketLimiter(3, 3.0)
    assert all(limiter.try_admit("k", 1, 10.0).ok for _ in range(3))
    denied = limiter.try_admit("k", 1, 10.25)
    assert not denied.ok and denied.retry_after_s == pytest.approx(0.75)
    assert limiter.try_admit("k", 1, 10.25 + denied.retry_after_s).ok


def test_unlimited_admits_everything_but_keeps_stats() -> None:
    limiter = TokenBucketLimiter(None, 60.0)
    for i in range(5):
        assert limiter.try_admit("k", 1000, float(i)).ok
    assert limiter.max_window_sum() == 5000 and limiter.total() == 5000
    assert limiter.max_burst() is None and limiter.rate is None


def test_backwards_clock_cannot_break_the_guarantee() -> None:
    limiter = TokenBucketLimiter(10, 60.0)
    assert limiter.try_admit("k", 10, 100.0).ok
    assert not limiter.try_admit("k", 1, 50.0).ok  # treated as t=100
    assert limiter.try_admit("k", 10, 160.0).ok
    assert limiter.max_burst() == pytest.approx(10.0)


def test_limit_changed_at_run_time() -> None:
    limiter = TokenBucketLimiter(100, 10.0)
    assert limiter.try_admit("k", 10, 0.0).ok
    limiter.limit = 40  # the level (90) is capped at the new capacity
    assert limiter.check("k", 0, 0.0).remaining == 40
    denied = limiter.try_admit("k", 41, 0.0)
    assert not denied.ok and denied.retry_after_s == math.inf
    assert limiter.try_admit("k", 40, 0.0).ok
    denied = limiter.try_admit("k", 8, 0.5)  # refills at 4 per second now
    assert not denied.ok and denied.retry_after_s == pytest.approx(1.5)


def test_history_and_clear() -> None:
    limiter = TokenBucketLimiter(100, 10.0, history_size=2)
    for i, amount in enumerate((5, 6, 7)):
        assert limiter.try_admit("k", amount, float(i), entry_id=f"r{i}").ok
    assert limiter.amount_of("r2") == 7
    with pytest.raises(KeyError):
        limiter.amount_of("r0")  # dropped from the history
    assert limiter.total() == 13
    limiter.clear()
    assert limiter.known_keys() == [] and limiter.check("k", 0, 3.0).remaining == 100
    with pytest.raises(ValueError):
        limiter.try_admit("k", -1, 3.0)
    with pytest.raises(ValueError):
        TokenBucketLimiter(10, 0.0)


def test_max_burst_of_events() -> None:
    assert max_burst([], 1.0) == 0.0
    assert max_burst([(0.0, 5), (1.0, 5)], 2.0) == pytest.approx(8.0)  # 10 - 2 * 1
    assert max_burst([(0.0, 5), (10.0, 5)], 2.0) == pytest.approx(5.0)
    assert max_burst([(3.0, 4), (3.0, 4)], 100.0) == pytest.approx(8.0)  # ties together


def test_own_count_charge() -> None:
    assert own_count_charge(0, 10) == 10
    assert own_count_charge(1, 10) == 11
    assert own_count_charge(8, 10) == 12
    assert own_count_charge(9, 10) == 13
    with pytest.raises(ValueError):
        own_count_charge(-1, 1)


def test_config_cli_and_runtime_switch() -> None:
    assert SimulatorConfig().limiter == "window"
    with pytest.raises(ValueError, match="limiter"):
        SimulatorConfig(limiter="leaky")  # type: ignore[arg-type]
    args = build_parser().parse_args(["--limiter", "bucket", "--latency-base-ms", "200"])
    config = config_from_args(args)
    assert config.limiter == "bucket" and config.latency_base_ms == 200.0
    assert config_from_args(build_parser().parse_args([])).limiter == "window"

    state = SimState(SimulatorConfig(tokens_per_min=1000, requests_per_min=10))
    assert isinstance(state.tokens, SlidingWindowLimiter) and not state.bucket_mode
    assert state.charge(prompt_tokens=7, body_bytes=400, max_tokens=20) == 27
    state.apply_config({"limiter": "bucket"})
    assert isinstance(state.tokens, TokenBucketLimiter) and state.bucket_mode
    assert isinstance(state.requests, TokenBucketLimiter)
    assert state.charge(prompt_tokens=7, body_bytes=400, max_tokens=20) == 120
    with pytest.raises(ValueError):
        state.apply_config({"limiter": "leaky"})
    state.apply_config({"tokens_per_min": 500})
    assert state.tokens.limit == 500 and state.config.as_dict()["limiter"] == "bucket"


def test_state_admits_in_both_buckets_and_reports_the_bound() -> None:
    state = SimState(
        SimulatorConfig(tokens_per_min=1000, requests_per_min=5, limiter="bucket", window_s=600)
    )
    key = ("key_x", "m")
    req, tok = state.admit(key, 900, "r1")
    assert req.ok and tok.ok and tok.remaining == 100 and req.remaining == 4
    req, tok = state.admit(key, 200, "r2")  # tokens refuse: nothing is taken from either
    assert req.ok and not tok.ok and tok.remaining == 100 and 0 < tok.retry_after_s <= 60.0
    assert req.remaining == 4
    assert state.settle(key, "r1", prompt=10, delivered=3) == 900  # charges are final
    bound = state.stats()["bound"]
    assert state.stats()["limiter"] == "bucket"
    assert bound["tokens"]["capacity"] == 1000 and bound["tokens"]["admitted"] == 900
    assert bound["tokens"]["refill_per_s"] == pytest.approx(1000 / 600)
    assert bound["tokens"]["max_burst"] == pytest.approx(900)
    assert bound["tokens"]["respected"] is True and bound["requests"]["admitted"] == 1
    window = SimState(SimulatorConfig(tokens_per_min=1000)).stats()["bound"]
    assert window["tokens"] == {"limit": 1000, "max_in_any_window": 0, "respected": True}
    assert window["requests"]["respected"] is None
