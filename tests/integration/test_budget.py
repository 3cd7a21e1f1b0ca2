"""The Redis budget (Lua): a property test on a simulated clock, and its edges."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.budget import Budget, charged_tokens, countdown_s
from app.concurrency import Slots
from app.config import Settings
from app.providers.base import RateLimitState
from app.redis_client import get_redis
from app.registry import ChargePolicy, ModelSpec

pytestmark = pytest.mark.integration

WINDOW_S = 60.0
GUARD_S = 1.0


def spec(tpm: int = 1000, rpm: int = 20, key: str = "acct") -> ModelSpec:
    return ModelSpec(
        name=f"m-{key}",
        provider="openai",
        base_url="http://x/v1",
        api_key_env="K",
        group="g",
        budget_key=key,
        context_window=10_000,
        max_output_tokens=500,
        tokens_per_min=tpm,
        requests_per_min=rpm,
        max_concurrency=2,
        input_usd_per_1m=1,
        output_usd_per_1m=1,
    )


@pytest.fixture
def budget(clean_db):
    return Budget(get_redis(), Settings(budget_window_s=WINDOW_S, budget_guard_s=GUARD_S))


# An operation: (seconds since the previous one, kind, tokens, share kept on reconcile)
ops = st.lists(
    st.tuples(
        st.floats(0, 20, allow_nan=False),
        st.sampled_from(["reserve", "reserve", "reserve", "reconcile", "release"]),
        st.integers(1, 400),
        st.floats(0, 1),
    ),
    min_size=1,
    max_size=60,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sequence=ops, tenant_limit=st.sampled_from([0, 600]))
def test_tokens_charged_in_any_window_never_exceed_the_limit(budget, sequence, tenant_limit):
    """Concurrent reservations and reconciliations interleaved on a simulated clock."""
    get_redis().flushdb()
    s = spec(tpm=1000, rpm=20)
    now = 1_000_000.0
    charged: dict[str, tuple[float, int]] = {}  # id -> (grant time, current charge)
    n = 0
    for gap, kind, tokens, keep in sequence:
        now += gap
        if kind == "reserve":
            n += 1
            rid = f"r{n}"
            grant = budget.reserve(
                s, rid, tokens, tenant_id=7, tenant_tokens_per_min=tenant_limit or None, now_s=now
            )
            if grant.granted:
                charged[rid] = (now, tokens)
            else:
                assert grant.never or grant.wait_s > 0
        elif charged:
            rid = sorted(charged)[int(keep * (len(charged) - 1))]
            granted_at, amount = charged[rid]
            if kind == "release":
                budget.release(s, rid, tenant_id=7)
                charged.pop(rid)
            else:  # the provider charged at most what was reserved
                new = int(amount * keep)
                budget.reconcile(s, rid, new, tenant_id=7)
                charged[rid] = (granted_at, new)
        # Every window of WINDOW_S seconds ending at a grant holds ≤ the limits.
        for end, _ in charged.values():
            inside = [a for t, a in charged.values() if end - WINDOW_S < t <= end]
            assert sum(inside) <= s.tokens_per_min
            assert len(inside) <= s.requests_per_min
            if tenant_limit:
                assert sum(inside) <= tenant_limit


def test_denial_says_when_capacity_frees(budget):
    s = spec(tpm=1000)
    assert budget.reserve(s, "a", 600, now_s=100.0).granted
    assert budget.reserve(s, "b", 300, now_s=110.0).granted
    denied = budget.reserve(s, "c", 300, now_s=120.0)
    assert not denied.granted
    # "a" leaves the window at 100 + 60 + 1 = 161: 41 s from now.
    assert denied.wait_s == pytest.approx(41.0, abs=0.01)
    assert budget.reserve(s, "c", 300, now_s=120.0 + denied.wait_s + 0.001).granted


def test_requests_per_minute_and_too_large(budget):
    s = spec(tpm=10_000, rpm=2)
    assert budget.reserve(s, "a", 1, now_s=0.0).granted
    assert budget.reserve(s, "b", 1, now_s=1.0).granted
    assert budget.reserve(s, "c", 1, now_s=2.0).wait_s == pytest.approx(59.0, abs=0.01)
    assert budget.reserve(s, "d", 10_001, now_s=2.0).never


def test_release_and_reconcile_give_tokens_back(budget):
    s = spec(tpm=1000)
    assert budget.reserve(s, "a", 900, now_s=0.0).granted
    assert not budget.reserve(s, "b", 200, now_s=1.0).granted
    assert budget.reconcile(s, "a", 500) == -400  # actual charge policy refund
    assert budget.reserve(s, "b", 200, now_s=1.0).granted
    assert budget.release(s, "b") == -200
    assert budget.used(s) == (500, 1)


def test_models_sharing_a_budget_key_share_the_budget(budget):
    a, b = spec(tpm=1000, key="shared"), spec(tpm=1000, key="shared")
    assert budget.reserve(a, "x", 700, now_s=0.0).granted
    assert not budget.reserve(b, "y", 700, now_s=0.0).granted


def test_cooldown_after_429_denies_until_it_ends(budget):
    s = spec()
    budget.cool_down(s, 5.0)
    denied = budget.reserve(s, "a", 1)
    assert not denied.granted and 4.0 < denied.wait_s <= 5.0


def test_provider_reporting_less_capacity_lowers_the_budget(budget):
    s = spec(tpm=1000)
    assert budget.reserve(s, "a", 100, now_s=0.0).granted
    # We think 900 remain; the provider says 400 (it counts tokens differently).
    added = budget.observe(
        s, RateLimitState(remaining_tokens=400, reset_tokens_s=10.0), "a", now_s=0.0
    )
    assert added == 500
    assert not budget.reserve(s, "b", 500, now_s=1.0).granted
    assert budget.reserve(s, "b", 400, now_s=1.0).granted
    # The observation leaves when the provider's counter resets (10 s), not after a window.
    assert budget.reserve(s, "c", 400, now_s=10.5).granted
    # A provider reporting more than we think changes nothing.
    assert budget.observe(s, RateLimitState(remaining_tokens=10_000), "c", now_s=11.0) == 0


def test_concurrency_slots_are_global_and_leased(clean_db):
    slots = Slots(get_redis())
    assert slots.acquire("m", "w1", limit=2, lease_s=30)
    assert slots.acquire("m", "w2", limit=2, lease_s=30)
    assert not slots.acquire("m", "w3", limit=2, lease_s=30)
    slots.release("m", "w1")
    assert slots.acquire("m", "w3", limit=2, lease_s=30)
    # A holder that died: its lease runs out and the slot frees itself.
    assert slots.acquire("n", "dead", limit=1, lease_s=0.05)
    assert not slots.acquire("n", "live", limit=1, lease_s=30)
    import time

    time.sleep(0.1)
    assert slots.acquire("n", "live", limit=1, lease_s=30)


def test_budget_maths():
    assert charged_tokens(ChargePolicy.RESERVE, 100, 20, 300) == 400
    assert charged_tokens(ChargePolicy.ACTUAL, 100, 20, 300) == 120
    waits = [countdown_s(10.0) for _ in range(50)]
    assert all(10.0 <= w <= 11.0 for w in waits) and len(set(waits)) > 1
