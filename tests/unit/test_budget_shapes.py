"""A budget shaped like the provider's limiter, pure: the bucket's arithmetic, the
calibration from headers, the learned ratio, the registry's limit_shape, 429 headers,
and the gate's one-script loop (no servers; the Lua twins are tested in
tests/integration/test_budget.py)."""

from __future__ import annotations

import math
import random
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.domain.scheduling.rate_limits import (
    RATIO_START,
    RateLimitState,
    bucket_grants,
    bucket_level,
    bucket_margin,
    bucket_wait_s,
    calibrated_level,
    interval_ratio_sample,
    ratio_update,
    scaled_prompt_tokens,
    usage_ratio_sample,
    window_observation,
)
from batchgen.errors import ConfigError, RateLimited
from batchgen.registry import LimitShape, parse_registry, shape_arg

CAPACITY, WINDOW_S, GUARD_S = 6000.0, 60.0, 1.0
RATE = CAPACITY / WINDOW_S


class Bucket:
    """Our bucket in pure Python, as budget_reserve.lua / budget_settle.lua keep it."""

    def __init__(self, capacity: float = CAPACITY, rate: float = RATE, guard_s: float = GUARD_S):
        self.capacity, self.rate, self.guard_s = capacity, rate, guard_s
        self.level: float | None = None
        self.last: float | None = None

    def at(self, now: float) -> float:
        return bucket_level(self.level, self.last, now, self.capacity, self.rate)

    def reserve(self, tokens: float, now: float, held: float = 0.0) -> float:
        """0 when granted (and taken), else the wait."""
        level = self.at(now)
        margin = bucket_margin(self.capacity, self.rate, self.guard_s, tokens)
        if bucket_grants(level, tokens, held, margin):
            self.level, self.last = level - tokens, now
            return 0.0
        return bucket_wait_s(level, tokens + held + margin, self.rate)

    def refund(self, tokens: float, now: float) -> None:
        self.level, self.last = min(self.capacity, self.at(now) + tokens), now


def max_excess(events: list[tuple[float, float]], capacity: float, rate: float) -> float:
    """Largest (net amount at times in [t0, t1]) - capacity - rate * (t1 - t0)."""
    per_instant: dict[float, float] = {}  # an interval holds all of an instant's events
    for t, amount in events:
        per_instant[t] = per_instant.get(t, 0.0) + amount
    ordered = sorted(per_instant.items())
    worst = -math.inf
    for i, (t0, _) in enumerate(ordered):
        total = 0.0
        for t1, amount in ordered[i:]:
            total += amount
            worst = max(worst, total - capacity - rate * (t1 - t0))
    return worst


# --- the bucket -------------------------------------------------------------------------


@given(
    st.lists(
        st.tuples(
            st.floats(0, 10, allow_nan=False),  # seconds since the previous operation
            st.integers(1, 6000),  # tokens asked for
            st.floats(0, 3000, allow_nan=False),  # claims held ahead
            st.floats(0, 1, allow_nan=False),  # 0..0.3: refund that share of the last grant
        ),
        max_size=60,
    )
)
def test_the_bucket_never_grants_more_than_capacity_plus_refill(ops):
    bucket, now = Bucket(), 0.0
    events: list[tuple[float, float]] = []
    grants: list[float] = []
    for gap, tokens, held, refund in ops:
        now += gap
        if refund < 0.3 and grants:
            back = grants.pop() * refund / 0.3
            bucket.refund(back, now)
            events.append((now, -back))
        elif bucket.reserve(tokens, now, held) == 0.0:
            grants.append(tokens)
            events.append((now, tokens))
        assert bucket.at(now) <= CAPACITY
    assert max_excess(events, CAPACITY, RATE) <= 1e-6


@given(
    level=st.floats(-6000, 6000, allow_nan=False),
    tokens=st.integers(1, 6000),
    held=st.floats(0, 6000, allow_nan=False),
)
def test_a_denied_reservation_is_granted_after_its_wait_not_before(level, tokens, held):
    bucket = Bucket()
    bucket.level, bucket.last = level, 0.0
    wait = bucket.reserve(tokens, 0.0, held)
    if wait == 0.0:
        return
    assert wait > 0
    if tokens + held + bucket_margin(CAPACITY, RATE, GUARD_S, tokens) <= CAPACITY:
        assert bucket.reserve(tokens, wait + 1e-9, held) == 0.0  # refilled by then
    if wait > 1e-3:
        assert bucket.reserve(tokens, wait - 1e-3, held) > 0.0


def test_a_bucket_refills_continuously_and_keeps_a_guard_in_hand():
    bucket = Bucket()
    assert bucket.reserve(6000, 0.0) == 0.0  # a full bucket grants its capacity at once
    # 50 tokens refill in half a second; with 100 (one guard second) kept in hand: 1.5 s.
    assert bucket.reserve(50, 0.0) == pytest.approx(1.5)
    assert bucket.reserve(50, 1.5) == 0.0
    assert bucket.at(1000.0) == CAPACITY  # never more than its capacity
    assert bucket_level(None, None, 5.0, CAPACITY, RATE) == CAPACITY  # a new bucket is full
    assert bucket_level(10.0, 5.0, 4.0, CAPACITY, RATE) == 10.0  # a clock that went back


def test_calibration_raises_and_lowers_the_level():
    # The provider had 5000 right after our call 0.5 s ago; we granted 2000 since.
    assert calibrated_level(5000, 0.5, CAPACITY, RATE, 2000) == 5050 - 2000
    # Never more than a full bucket, however long ago.
    assert calibrated_level(5990, 30.0, CAPACITY, RATE, 0) == CAPACITY
    # Below zero: we owe the provider; the bucket refills from there.
    assert calibrated_level(0, 0.0, CAPACITY, RATE, 700) == -700
    # Window: less than we believe is charged, more takes observations back.
    assert window_observation(1000, 100, 400) == 500
    assert window_observation(1000, 700, 700) == -400


# --- the learned ratio -------------------------------------------------------------------


def test_the_ratio_converges_on_a_provider_counting_26_percent_more():
    ratio, steps = RATIO_START, []
    for _ in range(8):
        ratio = ratio_update(ratio, 1.26, 0.3, 0.5, 3.0)
        steps.append(ratio)
    assert steps == sorted(steps) and all(r < 1.26 for r in steps)  # monotone, no overshoot
    assert ratio == pytest.approx(1.26, rel=0.02)  # 0.26 * 0.7 ** 8 = 0.015


@given(
    ratio=st.floats(0.5, 3.0),
    sample=st.floats(-100, 100, allow_nan=False),
    weight=st.floats(0, 1),
)
def test_a_ratio_step_moves_towards_the_clamped_sample_and_stays_in_range(ratio, sample, weight):
    new = ratio_update(ratio, sample, weight, 0.5, 3.0)
    target = min(3.0, max(0.5, sample))
    assert 0.5 <= new <= 3.0
    assert min(ratio, target) - 1e-12 <= new <= max(ratio, target) + 1e-12


def test_an_unusable_sample_leaves_the_ratio():
    assert ratio_update(1.2, math.nan, 0.3, 0.5, 3.0) == 1.2
    assert ratio_update(1.2, math.inf, 0.3, 0.5, 3.0) == 1.2
    assert usage_ratio_sample(130, 100) == 1.3
    assert usage_ratio_sample(13, 10) is None  # a tiny prompt: framing, not the tokenizer
    assert usage_ratio_sample(0, 100) is None


def test_an_interval_between_two_headers_recovers_the_providers_count():
    """The provider (a bucket of our limits) charges ceil(1.26 × est) + max_tokens."""
    rng = random.Random(3)
    provider, t = Bucket(60_000, 1000, guard_s=0.0), 0.0
    provider.reserve(30_000, t)  # busy: never full in between
    start_remaining, start_t = provider.at(t), t
    est_sum = rest_sum = 0
    for _ in range(5):
        t += rng.uniform(0.1, 0.5)
        est = rng.randint(100, 400)
        assert provider.reserve(math.ceil(1.26 * est) + 50, t) == 0.0
        est_sum, rest_sum = est_sum + est, rest_sum + 50
    sample = interval_ratio_sample(
        start_remaining=start_remaining,
        end_remaining=provider.at(t),
        elapsed_s=t - start_t,
        capacity=60_000,
        rate=1000,
        rest_tokens=rest_sum,
        prompt_est=est_sum,
        calls=5,
        min_calls=4,
    )
    assert sample == pytest.approx(1.26, abs=0.01)


def test_an_interval_says_nothing_when_it_may_have_been_full_or_is_too_short():
    args = {"capacity": CAPACITY, "rate": RATE, "rest_tokens": 0, "prompt_est": 1000}
    full = interval_ratio_sample(
        start_remaining=5950, end_remaining=5000, elapsed_s=1.0, calls=5, min_calls=4, **args
    )
    assert full is None  # 5950 + 100 of refill reaches the capacity: the refill may be cut
    few = interval_ratio_sample(
        start_remaining=0, end_remaining=0, elapsed_s=1.0, calls=3, min_calls=4, **args
    )
    assert few is None


def test_the_ratio_learned_from_intervals_makes_reservations_cover_the_charge():
    """Calls one after another against a provider counting 1.26 × our estimate: the
    ratio learned from every interval of four calls, and soon each reservation is
    within 1 % of what the provider charges (at first: 20 % short)."""
    rng = random.Random(5)
    provider, t, ratio = Bucket(60_000, 1000, guard_s=0.0), 0.0, RATIO_START
    provider.reserve(30_000, t)  # busy, never full: 300 refilled a call, ~370 charged
    start = (provider.at(t), t)
    interval: list[tuple[int, int]] = []
    covered: list[float] = []  # reserved / charged
    while len(covered) < 60:
        t += 0.3
        est, max_tokens = rng.randint(150, 400), 20
        reserved = scaled_prompt_tokens(est, ratio) + max_tokens
        charge = math.ceil(1.26 * est) + max_tokens
        assert provider.reserve(charge, t) == 0.0
        covered.append(reserved / charge)
        interval.append((est, max_tokens))
        sample = interval_ratio_sample(
            start_remaining=start[0],
            end_remaining=provider.at(t),
            elapsed_s=t - start[1],
            capacity=60_000,
            rate=1000,
            rest_tokens=sum(m for _, m in interval),
            prompt_est=sum(e for e, _ in interval),
            calls=len(interval),
            min_calls=4,
        )
        if sample is not None:
            ratio = ratio_update(ratio, sample, 0.3, 0.5, 3.0)
            start, interval = (provider.at(t), t), []
    assert ratio == pytest.approx(1.26, abs=0.01)
    assert covered[0] < 0.85
    assert min(covered[40:]) >= 0.99


def test_the_prompt_part_is_scaled_and_capped():
    from batchgen.limits.budget import reservation_tokens

    assert scaled_prompt_tokens(1000, 1.26) == 1260
    assert scaled_prompt_tokens(3, 1.26) == 4  # rounded up
    assert scaled_prompt_tokens(0, 2.0) == 0
    assert scaled_prompt_tokens(100, 1.0) == 100  # no float slack rounds 100.0 up
    assert reservation_tokens(1000, 200) == 1200
    assert reservation_tokens(1000, 200, ratio=1.26) == 1460
    assert reservation_tokens(1000, 200, ratio=3.0, limit=2000) == 2000


def test_the_jitter_is_the_same_formula_everywhere():
    from batchgen.limits.budget import countdown_s, jittered_s

    assert jittered_s(10.0, 0.0) == 10.0
    assert jittered_s(10.0, 0.5) == pytest.approx(10.0 + 0.5 * 1.0)
    assert jittered_s(2.0, 1.0) == pytest.approx(2.0 + 0.25)
    rng_a, rng_b = random.Random(1), random.Random(1)
    assert countdown_s(3.0, rng_a) == jittered_s(3.0, rng_b.random())


# --- the registry --------------------------------------------------------------------------

MODEL = """
[models."{name}"]
provider = "openai"
base_url = "http://localhost:1/v1"
api_key_env = "K"
group = "g"
budget_key = "{key}"
context_window = 1000
max_output_tokens = 10
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 2
input_usd_per_1m = 1
output_usd_per_1m = 2
"""


def model(name: str, key: str, shape: str | None = None) -> str:
    text = MODEL.format(name=name, key=key)
    return text + (f'limit_shape = "{shape}"\n' if shape else "")


def test_the_limit_shape_is_learned_unless_set_and_is_checked():
    registry = parse_registry(model("a", "x") + model("b", "y", "bucket"))
    assert registry["a"].limit_shape is None  # learned from the headers, a bucket first
    assert registry["a"].deployments[0].limit_shape is None
    assert shape_arg(registry["a"].deployments[0].limit_shape) == "learn"
    assert registry["b"].limit_shape is LimitShape.BUCKET
    with pytest.raises(ConfigError, match="model 'a': limit_shape"):
        parse_registry(model("a", "x", "leaky"))


def test_models_sharing_a_budget_key_must_agree_on_the_shape():
    parse_registry(model("a", "acct", "bucket") + model("b", "acct", "bucket"))
    with pytest.raises(ConfigError, match="limit_shape .*'a': window, 'b': bucket"):
        parse_registry(model("a", "acct", "window") + model("b", "acct", "bucket"))


def test_a_model_sharing_a_budget_key_takes_the_shape_another_sets():
    registry = parse_registry(model("a", "acct") + model("b", "acct", "window"))
    assert registry["a"].limit_shape is LimitShape.WINDOW
    assert registry["a"].deployments[0].limit_shape is LimitShape.WINDOW
    registry = parse_registry(model("a", "acct") + model("b", "acct"))
    assert {registry[m].deployments[0].limit_shape for m in "ab"} == {None}


def test_the_shipped_registry_loads():
    from pathlib import Path

    from batchgen.registry import load_registry

    path = Path(__file__).resolve().parents[2] / "app" / "models.toml"
    assert {m.limit_shape for m in load_registry(path)} == {LimitShape.WINDOW}


# --- the headers of a 429 --------------------------------------------------------------------

OPENAI_429 = {
    "retry-after": "2",
    "x-ratelimit-remaining-tokens": "120",
    "x-ratelimit-remaining-requests": "7",
    "x-ratelimit-reset-tokens": "1.5s",
}
ANTHROPIC_429 = {
    "retry-after": "3",
    "anthropic-ratelimit-tokens-remaining": "40",
    "anthropic-ratelimit-requests-remaining": "2",
}


@pytest.mark.parametrize(
    ("headers", "tokens", "requests"),
    [(OPENAI_429, 120, 7), (ANTHROPIC_429, 40, 2)],
    ids=["openai", "anthropic"],
)
def test_a_429_carries_its_rate_limit_headers(headers, tokens, requests):
    from batchgen.providers.base import classify_status

    error = classify_status(429, "HTTP 429", headers, "rate_limit_exceeded")
    assert isinstance(error, RateLimited) and error.retry_after_s is not None
    assert isinstance(error.rate_limits, RateLimitState)
    assert error.rate_limits.remaining_tokens == tokens
    assert error.rate_limits.remaining_requests == requests
    assert error.rate_limits.reported


def test_a_429_without_rate_limit_headers_carries_none():
    from batchgen.providers.base import classify_status
    from batchgen.providers.headers import rate_limits_of

    error = classify_status(429, "HTTP 429", {"retry-after": "1"}, None)
    assert isinstance(error, RateLimited) and error.rate_limits is None
    assert rate_limits_of(None) is None and rate_limits_of({}) is None
    assert RateLimited("429", retry_after_s=None).rate_limits is None
    assert not RateLimitState().reported


# --- the gate: one script per try ----------------------------------------------------------


class ScriptedBudget:
    """Answers the gate's enter calls from a list; records the slot-denial flag."""

    def __init__(self, answers):
        from batchgen.limits.budget import Grant

        self.answers = [Grant(**a) for a in answers]
        self.flags: list[bool] = []

    def enter(self, spec, rid, prompt, rest, **kw):
        self.flags.append(kw["count_slot_denial"])
        assert kw["count"] and kw["slot_limit"] == spec.max_concurrency
        return self.answers.pop(0)


def gate_with(budget, slot_wait_s: float):
    from batchgen.config import Settings
    from batchgen.limits.gate import Gate

    gate = Gate(cast(Any, None), Settings(slot_wait_s=slot_wait_s))  # no Redis: scripted
    gate.budget = budget
    return gate


class Ticket:
    item_id, attempt, tenant_id, tenant_tokens_per_min = 7, 1, 3, None
    prompt_tokens_est, max_tokens = 100, 50


def test_the_gate_polls_the_one_script_for_a_slot_and_counts_one_denial(monkeypatch):
    from batchgen.limits import gate as gate_module
    from batchgen.limits.gate import Pass, Wait, WaitKind
    from tests.unit.test_settlement import RESERVE, spec

    monkeypatch.setattr(gate_module, "SLOT_POLL_S", 0.0)
    slot = {"granted": False, "reason": "slot"}
    granted = {"granted": True, "tokens": 170, "prompt_part": 120}
    budget = ScriptedBudget([slot, slot, granted])
    admitted = gate_with(budget, 60.0).enter(spec(RESERVE), Ticket())
    assert admitted == Pass("7:1", 170, 100)  # the tokens the script reserved (ratio applied)
    assert budget.flags == [False, False, False]
    budget = ScriptedBudget([slot])
    waited = gate_with(budget, 0.0).enter(spec(RESERVE), Ticket())
    assert isinstance(waited, Wait) and waited.kind is WaitKind.SLOT
    assert budget.flags == [True]  # the last try counts the slot denial, in the script


def test_the_gate_waits_the_countdown_the_script_counted():
    from batchgen.limits.gate import Never, Wait, WaitKind
    from tests.unit.test_settlement import RESERVE, spec

    denied = {"granted": False, "wait_s": 2.0, "reason": "tokens", "countdown_s": 2.13}
    waited = gate_with(ScriptedBudget([denied]), 1.0).enter(spec(RESERVE), Ticket())
    assert waited == Wait(2.13, "token budget exhausted", WaitKind.TOKENS)
    never = {"granted": False, "never": True, "reason": "never"}
    refused = gate_with(ScriptedBudget([never]), 1.0).enter(spec(RESERVE), Ticket())
    assert isinstance(refused, Never) and "150 tokens" in refused.reason
