"""The Redis budget (Lua): a property test on a simulated clock, and its edges."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from batchgen.config import Settings
from batchgen.domain.rate_limits import RateLimitState
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import get_redis
from batchgen.limits.budget import Budget, charged_tokens, countdown_s
from batchgen.limits.concurrency import Slots
from batchgen.registry import ChargePolicy, ModelSpec

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
    assert budget.used(s, now_s=1.0) == (500, 1)


def test_reservation_whose_reply_was_lost_is_adopted_by_its_retry(budget):
    """Redis stalled past the client's timeout, then ran the reserve anyway: the
    attempt, handed back unsent, retries with the same id and finds it granted,
    so one call keeps one reservation (not two, not one nobody settles)."""
    s = spec(tpm=1000, rpm=20)
    assert budget.reserve(s, "7:1", 400, now_s=10.0).granted  # the reply that was lost
    assert budget.reserve(s, "7:1", 400, now_s=15.0).granted  # the same attempt, retried
    assert budget.used(s, now_s=15.0) == (400, 1)
    # The running totals the reserve checks count it once too: 600 more still fit.
    assert budget.reserve(s, "9:1", 600, now_s=15.0).granted
    assert budget.release(s, "9:1") == -600
    assert budget.release(s, "7:1") == -400
    assert budget.used(s, now_s=15.0) == (0, 0)
    # Once out of the window, the same id is a new reservation.
    assert budget.reserve(s, "8:1", 300, now_s=20.0).granted
    assert budget.reserve(s, "8:1", 300, now_s=20.0 + WINDOW_S + GUARD_S + 1).granted
    assert budget.used(s, now_s=20.0 + WINDOW_S + GUARD_S + 1) == (300, 1)


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


# --- issue 10: cooldowns, stale headers, fairness for large requests, metrics ---------


def test_one_429_with_long_retry_after_expires_nothing(clean_db):
    """retry-after: 3600 on one call: the cooldown is capped, and an item whose deadline
    is nearer than the cooldown is handed back (not expired) since a probe may pass."""
    from sqlalchemy import update

    from batchgen import python_api as client
    from batchgen.config import get_settings
    from batchgen.errors import RateLimited
    from batchgen.limits.gate import Gate, Pass
    from batchgen.registry import get_registry
    from batchgen.store import db
    from batchgen.store.schema import Item
    from batchgen.worker.execution import run_item
    from tests.helpers import chat_line, make_tenant

    settings, registry = get_settings(), get_registry()
    small = registry["sim-small"]
    gate = Gate(get_redis(), settings)
    make_tenant("t")
    batch = client.submit_batch(
        [chat_line("a", model="sim-small")], tenant="t", completion_window="30s"
    )
    with db.session_scope() as s:
        item_id = s.scalar(select(Item.id).where(Item.batch_id == batch["id"]))
        s.execute(update(Item).where(Item.id == item_id).values(status="queued"))
    # Another call on the same account got a 429 asking for an hour.
    gate.settle(small, Pass("other:1", 10), 1, 10, error=RateLimited("429", retry_after_s=3600))
    assert 0 < get_redis().pttl(keys.cooldown(small.budget_key)) <= 60_000  # the default cap

    verdict = run_item(item_id, registry, settings, gate)

    assert verdict.outcome in ("wait", "deferred")
    with db.session_scope() as s:
        assert s.scalar(select(Item.status).where(Item.id == item_id)) in ("queued", "pending")


def test_cooldown_write_keeps_the_longer_cooldown(budget):
    """A 2 s and a 30 s cooldown written at the same instant: the 30 s one stays."""
    s = spec(key="racy")
    key = keys.cooldown(s.budget_key)
    lost = 0
    for _ in range(300):
        get_redis().delete(key)
        start = threading.Barrier(2)

        def write(seconds: float, start: threading.Barrier = start) -> None:
            start.wait()
            budget.cool_down(s, seconds)

        threads = [threading.Thread(target=write, args=(x,)) for x in (30.0, 2.0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lost += get_redis().pttl(key) <= 2000
    assert lost == 0


def test_stale_rate_limit_header_is_compared_with_the_window_when_received(budget):
    """A 20 s streamed call: its header, read at the start, counted a reservation that
    left our window during the call. That reservation is not "missing" at the end."""
    s = spec(tpm=1000)
    assert budget.reserve(s, "x", 600, now_s=-50.0).granted  # leaves the window at 11 s
    assert budget.reserve(s, "a", 100, now_s=0.0).granted
    # At 0.5 s the provider had counted both: 300 remain, reset in 60 s.
    header = RateLimitState(remaining_tokens=300, reset_tokens_s=60.0)
    assert budget.observe(s, header, "a", now_s=20.5, age_s=20.0) == 0
    assert budget.reserve(s, "b", 900, now_s=21.0).granted
    # A header from a call that outlived the whole window says nothing about it.
    assert budget.observe(s, header, "b", now_s=90.0, age_s=70.0) == 0
    # A fresh header that really reports less than we think still lowers the budget.
    fresh = RateLimitState(remaining_tokens=0, reset_tokens_s=10.0)
    assert budget.reserve(s, "c", 1, now_s=83.0).granted
    assert budget.observe(s, fresh, "c", now_s=83.5, age_s=0.2) == 999


def test_header_age_comes_from_when_it_was_received(budget):
    s = spec(tpm=1000)
    assert budget.reserve(s, "a", 600, now_s=0.0).granted
    received = time.monotonic() - 70.0  # a stream's headers, 70 s ago
    header = RateLimitState(remaining_tokens=400, reset_tokens_s=60.0, received_s=received)
    assert budget.observe(s, header, "a", now_s=70.5) == 0
    assert budget.used(s, now_s=70.5) == (0, 0)


LIMIT = 100_000
SPAN_S = WINDOW_S + GUARD_S


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n_workers=st.integers(3, 10),
    sizes=st.lists(st.sampled_from([1_000, 1_000, 1_000, 2_000, 30_000, 60_000]), min_size=3),
    call_s=st.floats(0.05, 3.0),
    jitter=st.floats(0.0, 1.0),
)
def test_large_requests_are_not_starved_by_small_ones(budget, n_workers, sizes, call_s, jitter):
    """Workers on a virtual clock, each taking the next request of a 1k..60k mix and
    retrying when told to: small traffic saturates the budget, yet every request is
    granted within two windows per request that was already waiting when it was first
    denied (first-denied, first-served), and no window holds more than the limit."""
    get_redis().flushdb()
    s = spec(tpm=LIMIT, rpm=1_000_000)
    end_s = 6 * SPAN_S
    wake: list[tuple[float, int]] = [(0.01 * w, w) for w in range(n_workers)]
    current: dict[int, tuple[str, int]] = {}
    first_denied: dict[str, float] = {}
    ahead: dict[str, int] = {}  # requests already waiting at its first denial
    granted: list[tuple[float, int]] = []
    served = 0
    while wake:
        wake.sort()
        now, w = wake.pop(0)
        if now > end_s:
            break
        if w not in current:
            served += 1
            current[w] = (f"i{served}", sizes[served % len(sizes)])
        item, tokens = current[w]
        grant = budget.reserve(s, f"{item}:r", tokens, waiter_id=item, now_s=now)
        if grant.granted:
            granted.append((now, tokens))
            if item in first_denied:
                bound = 2 * SPAN_S * (ahead[item] + 1) + 2 * jitter
                assert now - first_denied.pop(item) <= bound, (item, tokens, ahead[item])
            del current[w]
            wake.append((now + call_s, w))
        else:
            assert grant.reason == "tokens" and grant.wait_s > 0
            if item not in first_denied:
                ahead[item] = len(first_denied)
                first_denied[item] = now
            wake.append((now + grant.wait_s + jitter * (w % 2), w))
    for item, since in first_denied.items():  # still waiting at the end: not for too long
        assert end_s - since <= 2 * SPAN_S * (ahead[item] + 1) + 2 * jitter, item
    for t, _ in granted:
        assert sum(a for g, a in granted if t - WINDOW_S < g <= t) <= LIMIT


def test_a_vanished_waiter_frees_its_claim(budget):
    s = spec(tpm=100_000, rpm=1_000_000)
    assert budget.reserve(s, "small:1", 90_000, now_s=0.0).granted
    big = budget.reserve(s, "big:r", 30_000, waiter_id="big", now_s=1.0)
    assert not big.granted  # "big" now holds a claim on 30k tokens
    assert not budget.reserve(s, "s2:r", 5_000, waiter_id="s2", now_s=2.0).granted
    # "big" never comes back: after the claim's TTL others may use the capacity.
    later = 1.0 + budget.claim_ttl_s + 1.0
    assert budget.reserve(s, "s3:r", 90_000, waiter_id="s3", now_s=later).granted


def test_metrics_read_the_window_and_slots_on_redis_clock(budget, monkeypatch):
    s = spec(tpm=1000)
    assert budget.reserve(s, "new", 100).granted  # on Redis's clock: in the window
    seconds, micros = get_redis().time()
    redis_now = seconds + micros / 1e6
    assert budget.reserve(s, "old", 600, now_s=redis_now - 100.0).granted  # left it since
    assert budget.used(s) == (100, 1)  # no reservation has expired "old" yet
    slots = Slots(get_redis())
    assert slots.acquire("m", "live", limit=2, lease_s=30)
    assert slots.acquire("m", "gone", limit=2, lease_s=0.01)
    time.sleep(0.05)
    real = time.time
    for skew_s in (-3600.0, 3600.0):  # this host's clock an hour behind, then ahead
        monkeypatch.setattr(time, "time", lambda skew_s=skew_s: real() + skew_s)
        assert slots.held("m") == 1
