"""The Redis budget (Lua): a property test on a simulated clock, and its edges."""

from __future__ import annotations

import itertools
import math
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from batchgen.config import Settings
from batchgen.domain.scheduling.rate_limits import RateLimitState
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import get_redis
from batchgen.limits.budget import Budget, charged_tokens, countdown_s
from batchgen.limits.concurrency import Slots
from batchgen.registry import ChargePolicy, LimitShape, ModelSpec
from tests.registries import model_spec as spec  # m-<key>: 1000 tokens, 20 requests/min
from tests.waiting import hold, wait_until

pytestmark = pytest.mark.integration

WINDOW_S = 60.0
GUARD_S = 1.0


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
    wait_until(
        lambda: slots.acquire("n", "live", limit=1, lease_s=30), 5, "the dead lease to lapse"
    )


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


@pytest.mark.parametrize("shape", list(LimitShape))
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n_workers=st.integers(3, 10),
    sizes=st.lists(st.sampled_from([1_000, 1_000, 1_000, 2_000, 30_000, 60_000]), min_size=3),
    call_s=st.floats(0.05, 3.0),
    jitter=st.floats(0.0, 1.0),
)
def test_large_requests_are_not_starved_by_small_ones(
    budget, shape, n_workers, sizes, call_s, jitter
):
    """Workers on a virtual clock, each taking the next request of a 1k..60k mix and
    retrying when told to: small traffic saturates the budget, yet every request is
    granted within two windows per request that was already waiting when it was first
    denied (first-denied, first-served), and no window holds more than the limit (a
    bucket: no interval more than its capacity plus its refill)."""
    get_redis().flushdb()
    s = spec(tpm=LIMIT, rpm=1_000_000, shape=shape)
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
    if shape is LimitShape.WINDOW:
        for t, _ in granted:
            assert sum(a for g, a in granted if t - WINDOW_S < g <= t) <= LIMIT
    else:
        assert max_bucket_excess(granted, LIMIT, LIMIT / WINDOW_S) <= 1e-6


def max_bucket_excess(events: list[tuple[float, int]], capacity: float, rate: float) -> float:
    """The most the net amounts at times in any ``[t0, t1]`` exceed ``capacity + rate *
    (t1 - t0)`` (<= 0: a bucket of that capacity and rate could have granted them)."""
    per_instant: dict[float, float] = {}  # an interval holds all of an instant's events
    for t, amount in events:
        per_instant[t] = per_instant.get(t, 0.0) + amount
    ordered = sorted(per_instant.items())
    worst = -float("inf")
    for i, (t0, _) in enumerate(ordered):
        total = 0.0
        for t1, amount in ordered[i:]:
            total += amount
            worst = max(worst, total - capacity - rate * (t1 - t0))
    return worst


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
    wait_until(lambda: slots.held("m") == 1, 5, "the 10 ms lease to lapse", poll_s=0.01)
    real = time.time
    for skew_s in (-3600.0, 3600.0):  # this host's clock an hour behind, then ahead
        monkeypatch.setattr(time, "time", lambda skew_s=skew_s: real() + skew_s)
        assert slots.held("m") == 1


# --- the bucket shape, calibration both ways, the learned ratio, round trips ---------------

BUCKET = LimitShape.BUCKET


def _header(limit: int, remaining: int, reset_s: float) -> RateLimitState:
    return RateLimitState(
        remaining_tokens=remaining, limit_tokens=limit, reset_tokens_s=reset_s, received_s=None
    )


def test_a_shape_left_unset_starts_as_a_bucket_and_learns_a_window(budget):
    """No limit_shape: a bucket until budget_shape_samples headers in a row show a
    window's reset; then the budget is kept as a window (a full one waits for its
    charges to leave it, not for a second of refill)."""
    s = spec(tpm=6000, rpm=600, key="learn", shape=None)
    assert budget.shape(s) is BUCKET
    assert budget.reserve(s, "a", 5900, now_s=100.0).granted
    assert budget.reserve(s, "b", 100, now_s=102.0).granted  # refilled: a bucket
    assert budget.used(s, now_s=102.0)[0] < 6000
    # A window's header: 6000 used of 6000 would be a bucket's 60 s, but 2000 left
    # (a bucket's 40 s) with a reset of 59 s is not a bucket's.
    for i in range(budget.shape_samples - 1):
        budget.observe(s, _header(6000, 2000, 59.0), f"h{i}", now_s=102.0, age_s=0.0)
        assert budget.shape(s) is BUCKET  # not yet
    budget.observe(s, _header(6000, 2000, 59.0), "hz", now_s=102.0, age_s=0.0)
    assert budget.shape(s) is LimitShape.WINDOW
    assert redis_shape(s) == ("window", "0")
    # Now a window: what was granted holds it until it ages out of the window.
    assert budget.used(s, now_s=103.0)[0] >= 6000
    denied = budget.reserve(s, "c", 100, now_s=103.0)
    assert not denied.granted and denied.wait_s > 50
    # A bucket's headers bring it back, as many in a row.
    for i in range(budget.shape_samples):
        budget.observe(s, _header(6000, 3000, 30.0), f"k{i}", now_s=103.0, age_s=0.0)
    assert budget.shape(s) is BUCKET


def test_a_shape_set_in_the_registry_is_kept_whatever_the_headers_say(budget):
    s = spec(tpm=6000, rpm=600, key="kept", shape=BUCKET)
    for i in range(5):
        budget.observe(s, _header(6000, 5000, 59.0), f"h{i}", now_s=10.0, age_s=0.0)
    assert budget.shape(s) is BUCKET
    assert redis_shape(s) == (None, None)


def redis_shape(s: ModelSpec) -> tuple[str | None, str | None]:
    raw = get_redis().hmget(keys.budget_shape(s.budget_key), "shape", "n")
    return tuple(v.decode() if isinstance(v, bytes) else v for v in raw)  # type: ignore[return-value]


def test_bucket_grants_after_refill_within_a_second_not_after_a_window(budget):
    s = spec(tpm=6000, rpm=600, key="b", shape=BUCKET)  # 100 tokens and 10 requests a second
    # A full bucket (it starts full) grants its capacity in one piece ...
    assert budget.reserve(s, "all", 6000, now_s=0.0).granted
    # ... and otherwise keeps one guard_s of refill (100) in hand beside a request.
    assert budget.reserve(s, "a", 5800, now_s=100.0).granted  # refilled by 100 s: 200 left
    denied = budget.reserve(s, "b", 150, now_s=100.0)
    assert not denied.granted and denied.reason == "tokens"
    assert denied.wait_s == pytest.approx(0.5, abs=0.002)  # 150 + 100 - 200 at 100 a second
    assert not budget.reserve(s, "b", 150, now_s=100.4).granted
    assert budget.reserve(s, "b", 150, now_s=100.0 + denied.wait_s).granted
    # A window, as full, waits for "a" to leave it: 61 s.
    w = spec(tpm=6000, rpm=600, key="w")
    assert budget.reserve(w, "a", 5900, now_s=100.0).granted
    assert budget.reserve(w, "b", 150, now_s=100.0).wait_s == pytest.approx(61.0, abs=0.01)
    # A bucket never holds more than its capacity, however long it rests.
    assert budget.used(s, now_s=1000.0) == (0, 0)
    assert budget.reserve(s, "c", 6000, now_s=1000.0).granted
    assert not budget.reserve(s, "d", 1, now_s=1000.0).granted


def test_bucket_requests_refill_too(budget):
    s = spec(tpm=1_000_000, rpm=60, key="r", shape=BUCKET)  # one request a second
    for i in range(59):  # 60 less the one second kept in hand
        assert budget.reserve(s, f"q{i}", 1, now_s=10.0).granted
    denied = budget.reserve(s, "late", 1, now_s=10.0)
    assert denied.reason == "requests" and denied.wait_s == pytest.approx(1.0, abs=0.002)
    assert budget.reserve(s, "late", 1, now_s=11.0).granted


def test_bucket_reconcile_refunds_what_was_not_charged_and_release_everything(budget):
    s = spec(tpm=6000, rpm=600, key="b", shape=BUCKET)
    assert budget.reserve(s, "a", 5000, now_s=0.0).granted
    assert budget.used(s, now_s=0.0) == (5000, 1)
    assert budget.reconcile(s, "a", 3000, now_s=0.0) == -2000  # charged 3000 of 5000
    assert budget.used(s, now_s=0.0) == (3000, 1)
    assert budget.reserve(s, "b", 2000, now_s=0.0).granted
    assert budget.release(s, "b", now_s=0.0) == -2000  # the request comes back too
    assert budget.used(s, now_s=0.0) == (3000, 1)
    # Gone from the books: released twice is released once.
    assert budget.release(s, "b", now_s=0.0) == 0


def test_bucket_adopts_a_reservation_whose_reply_was_lost(budget):
    s = spec(tpm=1000, rpm=20, key="b", shape=BUCKET)
    first = budget.reserve(s, "7:1", 400, now_s=10.0)
    again = budget.reserve(s, "7:1", 400, now_s=10.0)
    assert first.granted and again.granted and again.tokens == first.tokens == 400
    assert budget.used(s, now_s=10.0) == (400, 1)  # charged once
    assert budget.release(s, "7:1", now_s=10.0) == -400
    assert budget.used(s, now_s=10.0) == (0, 0)


def test_bucket_keeps_the_fair_line_for_a_large_request(budget):
    s = spec(tpm=100_000, rpm=1_000_000, key="fair", shape=BUCKET)
    rate = 100_000 / WINDOW_S
    assert budget.reserve(s, "fill:1", 100_000, now_s=0.0).granted
    big = budget.reserve(s, "big:1", 30_000, waiter_id="big", now_s=1.0)
    margin = rate * GUARD_S  # the refill kept in hand
    assert not big.granted
    assert big.wait_s == pytest.approx((30_000 + margin - rate) / rate, abs=0.01)
    # 8.3k tokens have refilled by 5 s, but they are the large request's: a small one waits.
    small = budget.reserve(s, "s:1", 1_000, waiter_id="s", now_s=5.0)
    assert not small.granted and small.reason == "tokens"
    assert budget.reserve(s, "big:1", 30_000, waiter_id="big", now_s=1.0 + big.wait_s).granted
    assert not budget.reserve(s, "s:1", 1_000, waiter_id="s", now_s=1.0 + big.wait_s).granted


# An operation on a bucket: (seconds since the previous one, kind, tokens, share kept)
bucket_ops = st.lists(
    st.tuples(
        st.floats(0, 5, allow_nan=False),
        st.sampled_from(["reserve", "reserve", "reserve", "reconcile", "release"]),
        st.integers(1, 700),
        st.floats(0, 1),
    ),
    min_size=1,
    max_size=50,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sequence=bucket_ops)
# A reservation settled after it aged out of the window (r1, 65 s old) settles nothing.
@example(
    sequence=[(0.0, "reserve", 100, 0.0)]
    + [(5.0, "reserve", 1, 0.0)] * 13
    + [(0.0, "reconcile", 1, 0.0)]
)
def test_the_bucket_never_grants_more_than_capacity_plus_refill(budget, sequence):
    """Reservations, refunds and releases on a simulated clock: over any interval the
    tokens granted less those given back stay within capacity + rate × its length, and
    the level is the pure model's (batchgen.domain.scheduling.rate_limits)."""
    from batchgen.domain.scheduling.rate_limits import bucket_grants, bucket_level, bucket_margin

    get_redis().flushdb()
    s = spec(tpm=1000, rpm=1_000_000, key="prop", shape=BUCKET)
    rate = 1000 / WINDOW_S
    now, n = 1_000.0, 0
    level, last = None, None  # the pure model's
    charged: dict[str, int] = {}
    granted_at: dict[str, float] = {}
    events: list[tuple[float, int]] = []  # (time, tokens granted; negative: given back)
    for gap, kind, tokens, keep in sequence:
        now += gap
        model_level = bucket_level(level, last, now, 1000, rate)
        if kind == "reserve":
            n += 1
            grant = budget.reserve(s, f"r{n}", tokens, now_s=now)
            margin = bucket_margin(1000, rate, GUARD_S, tokens)
            assert grant.granted == bucket_grants(model_level, tokens, margin=margin)
            if grant.granted:
                charged[f"r{n}"], granted_at[f"r{n}"] = tokens, now
                events.append((now, tokens))
                level, last = model_level - tokens, now
        else:
            # Settled within the window: a reservation older than that has aged out of
            # the log (the bucket refilled it long since) and settles nothing.
            live = sorted(r for r in charged if now - granted_at[r] < WINDOW_S)
            if live:
                rid = live[int(keep * (len(live) - 1))]
                kept = charged[rid] - int(charged[rid] * keep)
                back = charged[rid] if kind == "release" else kept
                if kind == "release":
                    assert budget.release(s, rid, now_s=now) == -charged.pop(rid)
                else:
                    assert budget.reconcile(s, rid, charged[rid] - back, now_s=now) == -back
                    charged[rid] -= back
                events.append((now, -back))
                level, last = min(1000.0, model_level + back), now
        assert max_bucket_excess(events, 1000, rate) <= 1e-6
        assert (
            abs(budget.used(s, now_s=now)[0] - (1000 - bucket_level(level, last, now, 1000, rate)))
            <= 1
        )


def test_headers_raise_and_lower_the_bucket(budget):
    from batchgen.domain.scheduling.rate_limits import calibrated_level

    s = spec(tpm=6000, rpm=600, key="cal", shape=BUCKET)
    rate = 6000 / WINDOW_S
    assert budget.reserve(s, "a", 3000, now_s=100.0).granted
    assert budget.reserve(s, "b", 2000, now_s=100.2).granted
    ours = 6000 - budget.used(s, now_s=100.5)[0]  # 6000 - 3000 - 2000 + 50 refilled
    assert ours == 1050
    # Right after "a" the provider still had 5000 (it counted "a" as 1000): ours goes up.
    header = RateLimitState(remaining_tokens=5000, remaining_requests=590)
    target = calibrated_level(5000, 0.5, 6000, rate, granted_since=2000)
    assert budget.observe(s, header, "a", now_s=100.5, age_s=0.3) == -(target - ours) == -2000
    # Requests: 590 then, 5 refilled since, 1 granted after ("b").
    assert budget.used(s, now_s=100.5) == (6000 - 3050, 600 - (590 + 5 - 1))
    assert budget.reserve(s, "c", 2000, now_s=100.5).granted  # more than we had before
    # Right after "c" it had nothing left (someone else uses the account), where we
    # believe 1050 were left: ours goes down, to the 10 refilled since.
    empty = RateLimitState(remaining_tokens=0)
    assert budget.observe(s, empty, "c", now_s=100.6) == 1050
    denied = budget.reserve(s, "d", 100, now_s=100.6)
    assert not denied.granted  # 10 left, 100 asked for, 100 kept in hand
    assert denied.wait_s == pytest.approx((100 + 100 - 10) / rate, abs=0.01)
    # A header older than the log (a call outliving the window) says nothing.
    assert budget.observe(s, header, "gone", now_s=200.0, age_s=70.0) == 0


@pytest.mark.parametrize("spread_s", [0.05, 0.0])
def test_a_bucket_header_leaves_out_calls_granted_just_before_its_own(clean_db, spread_s):
    """Threads take their turns between grant and send: "a", granted 20 ms before "b",
    may reach the provider after it, so b's header (what the provider had left once it
    counted b) may not count a. Within the send spread, a is taken as not yet seen;
    "z", granted long before, as seen."""
    budget = Budget(
        get_redis(),
        Settings(budget_window_s=WINDOW_S, budget_guard_s=GUARD_S, budget_send_spread_s=spread_s),
    )
    s = spec(tpm=6000, rpm=600, key="spread", shape=BUCKET)
    rate = 6000 / WINDOW_S
    assert budget.reserve(s, "z", 500, now_s=99.8).granted
    assert budget.reserve(s, "a", 1000, now_s=100.0).granted
    assert budget.reserve(s, "b", 1000, now_s=100.02).granted
    header = RateLimitState(remaining_tokens=4000, remaining_requests=590)
    budget.observe(s, header, "b", now_s=100.3, age_s=0.0)
    level = 6000 - budget.used(s, now_s=100.3)[0]
    left_out = 1000 if spread_s > 0 else 0  # a's tokens, not yet seen by the provider
    assert level == pytest.approx(4000 + rate * 0.28 - left_out, abs=1)
    requests_level = 600 - budget.used(s, now_s=100.3)[1]
    assert requests_level == pytest.approx(590 + 0.28 * 600 / WINDOW_S - (left_out // 1000), abs=1)


def test_headers_of_a_429_are_heard(clean_db):
    """The gate settles a 429 whose headers say the provider is empty: the bucket drops
    to it (not only the cooldown), and in a window an observation charges the gap."""
    from batchgen.config import get_settings
    from batchgen.errors import RateLimited
    from batchgen.limits.gate import Gate, Pass

    gate = Gate(get_redis(), get_settings())
    for shape in LimitShape:
        s = spec(tpm=60_000, rpm=1000, key=f"429-{shape}", shape=shape)
        assert gate.budget.reserve(s, "1:1", 1000).granted
        headers = RateLimitState(remaining_tokens=0, remaining_requests=10, reset_tokens_s=30.0)
        error = RateLimited("429", retry_after_s=0.001, rate_limits=headers)
        gate.settle(s, Pass("1:1", 1000), 1, 500, error=error)
        tokens, _ = gate.budget.used(s)
        assert tokens >= 59_000, shape  # the provider's word, not our 1000 (released)


def test_the_window_takes_back_its_own_observations_when_the_provider_has_more(budget):
    s = spec(tpm=1000)
    assert budget.reserve(s, "a", 100, now_s=0.0).granted
    low = RateLimitState(remaining_tokens=400, reset_tokens_s=30.0)
    assert budget.observe(s, low, "a", now_s=0.0) == 500  # an observation of 500
    assert budget.reserve(s, "b", 100, now_s=1.0).granted
    assert budget.used(s, now_s=1.0) == (700, 2)
    # The provider has 700 left, we believe 300: 400 of the observation go back.
    assert budget.observe(s, RateLimitState(remaining_tokens=700), "b", now_s=1.5) == -400
    assert budget.used(s, now_s=1.5) == (300, 2)
    # Reservations are never taken back: only the observation's last 100.
    assert budget.observe(s, RateLimitState(remaining_tokens=1000), "b", now_s=2.0) == -100
    assert budget.used(s, now_s=2.0) == (200, 2)


def test_the_learned_ratio_is_applied_to_the_prompt(budget):
    """Window shape: the answers' usage says the provider counts prompts 30 % above our
    estimate; the ratio moves there and the prompt part of reservations with it."""
    from batchgen.domain.scheduling.rate_limits import ratio_update
    from batchgen.limits.budget import SettleOps

    s = spec(tpm=100_000, rpm=1000, key="ratio-w")
    expected: float | None = None  # no sample yet
    for i in range(10):
        rid = f"{i}:1"
        grant = budget.reserve(s, rid, 200 + 50, prompt_tokens=200, now_s=float(i))
        assert grant.granted
        so_far = budget.ratio_start if expected is None else expected
        assert grant.tokens == math.ceil(so_far * 200 - 1e-9) + 50  # the ratio so far
        ops = SettleOps("reconcile", charged_tokens=260 + 50, charged_rest=50)
        ops = SettleOps(**{**ops.__dict__, "usage_prompt_tokens": 260, "prompt_tokens_est": 200})
        settled = budget.settle(s, rid, ops, now_s=float(i))
        expected = ratio_update(expected, 1.3, budget.ratio_weight, 0.5, 3.0)
        assert settled.ratio == pytest.approx(expected)
    assert budget.ratio(s) == pytest.approx(1.3, abs=0.01)
    probe = budget.reserve(s, "probe", 1000 + 10, prompt_tokens=1000, now_s=20.0)
    assert probe.tokens == math.ceil(budget.ratio(s) * 1000 - 1e-9) + 10
    # Scaled, a reservation is still at most the limit (and never "never" for it).
    assert budget.reserve(s, "huge", 90_000, prompt_tokens=90_000, now_s=200.0).tokens == 100_000


def test_before_the_first_sample_prompts_are_reserved_at_the_start_ratio(budget):
    """A fresh model reserves its prompts at budget_ratio_start (a first burst must not
    overshoot a provider that counts above tiktoken); the first sample, here a provider
    counting 10 % below our estimate, replaces it whole, not by a weighted step."""
    from batchgen.limits.budget import SettleOps

    s = spec(tpm=100_000, rpm=1000, key="ratio-start")
    assert budget.ratio_start == 1.3 and budget.ratio(s) == 1.3
    first = budget.reserve(s, "1:1", 1000 + 10, prompt_tokens=1000, now_s=0.0)
    assert first.tokens == 1300 + 10 and first.prompt_part == 1300
    ops = SettleOps("reconcile", charged_tokens=900 + 10, charged_rest=10)
    ops = SettleOps(**{**ops.__dict__, "usage_prompt_tokens": 900, "prompt_tokens_est": 1000})
    assert budget.settle(s, "1:1", ops, now_s=0.5).ratio == pytest.approx(0.9)
    assert budget.reserve(s, "2:1", 1000 + 10, prompt_tokens=1000, now_s=1.0).tokens == 900 + 10


def test_a_bucket_with_token_headers_never_learns_from_the_usage(budget):
    """A bucket whose provider sends token headers learns its ratio from them alone:
    an answer settled after its header has gone stale (a slow stream, a loaded worker)
    carries the usage of the provider's tokenizer, which is not what its limiter
    counts, and must not move the ratio. Without headers, the usage is learned from."""
    from batchgen.limits.budget import SettleOps

    s = spec(tpm=100_000, rpm=1000, key="ratio-stale", shape=BUCKET)
    assert budget.reserve(s, "1:1", 1000 + 10, prompt_tokens=1000, now_s=0.0).granted
    header = RateLimitState(remaining_tokens=50_000, reset_tokens_s=WINDOW_S)
    usage = {"usage_prompt_tokens": 900, "prompt_tokens_est": 1000}
    ops = SettleOps("reconcile", 1000 + 10, 10, rate_limits=header, **usage)
    stale = WINDOW_S + GUARD_S + 5  # older than the span: the header is not read
    assert budget.settle(s, "1:1", ops, now_s=stale + 1, age_s=stale).ratio == 1.3
    assert budget.reserve(s, "2:1", 1000 + 10, prompt_tokens=1000, now_s=stale + 2).granted
    plain = SettleOps("reconcile", 1000 + 10, 10, **usage)
    assert budget.settle(s, "2:1", plain, now_s=stale + 3).ratio == pytest.approx(0.9)


def test_the_learned_ratio_converges_and_the_429s_stop(budget):
    """A provider whose limiter is a token bucket with our limits but counts each prompt
    26 % (± 5 %) above our estimate (as OpenAI's four bytes a token against tiktoken),
    called by 32 workers with long (streamed) calls. The ratio converges on 1.26 from
    the headers (not from the usage, which is the provider's tokenizer count), and
    after the first calls the provider refuses none; without the ratio it refuses
    half of them, the headers' calibration notwithstanding."""
    ratio, early, late = provider_run(budget, "learned")
    assert ratio == pytest.approx(1.26, abs=0.03)
    assert late <= 2, (early, late)
    unlearned = Budget(get_redis(), Settings(budget_window_s=WINDOW_S, budget_ratio_weight=0))
    ratio, early, late = provider_run(unlearned, "unlearned")
    assert ratio == 1.0 and late > 100, (early, late)


def provider_run(budget: Budget, key: str) -> tuple[float, int, int]:
    """600 calls against a token-bucket provider counting prompts 1.26 × ours, on a
    virtual clock: (the ratio learned, 429s in the first 100 calls, 429s after)."""
    import heapq

    from batchgen.limits.budget import SettleOps
    from batchgen.simulator.bucket import TokenBucketLimiter

    factor, max_tokens = 1.26, 150
    s = spec(tpm=60_000, rpm=100_000, key=key, shape=BUCKET)
    provider = TokenBucketLimiter(60_000, WINDOW_S)
    rng = random.Random(11)
    # Events in time order: (time, seq, worker, what, payload).
    events: list[tuple[float, int, int, str, object]] = []
    seq = itertools.count()
    for w in range(32):
        heapq.heappush(events, (0.001 * w, next(seq), w, "new", None))
    outcomes: list[bool] = []  # True: the provider admitted the call
    calls = 0
    while len(outcomes) < 600:
        now, _, w, what, payload = heapq.heappop(events)
        if what == "new":
            calls += 1
            what, payload = "try", (calls, rng.randint(300, 1500))
        if what == "try":
            n, est = payload  # type: ignore[misc]
            rid = f"{n}:1"
            grant = budget.reserve(s, rid, est + max_tokens, prompt_tokens=est, now_s=now)
            if not grant.granted:
                heapq.heappush(events, (now + grant.wait_s + 0.001, next(seq), w, "try", payload))
                continue
            sent = now + 0.005  # reaching the provider
            charge = math.ceil(rng.uniform(factor - 0.05, factor + 0.05) * est) + max_tokens
            admission = provider.try_admit("key", charge, sent)
            header = RateLimitState(
                remaining_tokens=admission.remaining, reset_tokens_s=admission.reset_s
            )
            usage = {"usage_prompt_tokens": est, "prompt_tokens_est": est}  # its tokenizer's
            ops = (
                SettleOps("reconcile", est + max_tokens, max_tokens, rate_limits=header, **usage)
                if admission.ok
                else SettleOps("release", rate_limits=header)
            )
            # A stream's headers come at its start; it is settled at its end.
            done = sent + (rng.uniform(5.0, 20.0) if admission.ok else 0.02)
            heapq.heappush(events, (done, next(seq), w, "settle", (rid, ops, sent)))
            outcomes.append(admission.ok)
        elif what == "settle":
            rid, ops, sent = payload  # type: ignore[misc]
            budget.settle(s, rid, ops, now_s=now, age_s=now - sent)
            heapq.heappush(events, (now, next(seq), w, "new", None))
    return budget.ratio(s), outcomes[:100].count(False), outcomes[100:].count(False)


def test_one_script_to_enter_and_one_to_settle(clean_db):
    """Redis round trips on the hot path, seen by MONITOR: entering the gate is one
    EVALSHA (slot and budget), settling is one EVALSHA (reconcile, headers, ratio,
    counters, slot); a denial is one too, counters included."""
    from batchgen.config import get_settings
    from batchgen.limits.gate import Gate, Pass, Wait

    class Ticket:
        tenant_id, tenant_tokens_per_min, prompt_tokens_est, max_tokens = 1, None, 400, 100

        def __init__(self, item_id: int) -> None:
            self.item_id, self.attempt = item_id, 1

    class Answer:
        prompt_tokens, completion_tokens = 410, 60
        rate_limits = RateLimitState(remaining_tokens=900_000, remaining_requests=100)

    gate = Gate(get_redis(), get_settings())
    for shape in LimitShape:
        s = spec(tpm=1_000_000, rpm=1000, key=f"rt-{shape}", shape=shape)
        warm = gate.enter(s, Ticket(1))  # loads the scripts (SCRIPT LOAD after NOSCRIPT)
        assert isinstance(warm, Pass)
        gate.settle(s, warm, 1, 100, response=Answer())

        admitted, entered = client_commands(lambda s=s: gate.enter(s, Ticket(2)))
        assert isinstance(admitted, Pass) and entered == ["EVALSHA"], entered
        _, settled = client_commands(
            lambda s=s, p=admitted: gate.settle(s, p, 1, 100, response=Answer())
        )
        assert settled == ["EVALSHA"], settled
        assert get_redis().zcard(keys.slots(s.name)) == 0

        gate.budget.cool_down(s, 5.0)
        waited, denied = client_commands(lambda s=s: gate.enter(s, Ticket(3)))
        assert isinstance(waited, Wait) and denied == ["EVALSHA"], denied
        from batchgen.limits import counters

        assert counters.read(get_redis(), s.name)[counters.BUDGET_DENIALS] == 1
        get_redis().delete(keys.cooldown(s.budget_key))


def client_commands(action):  # type: ignore[no-untyped-def]
    """``action()``'s result and the commands clients sent Redis meanwhile (MONITOR; a
    script's own commands show as ``lua`` and are left out)."""
    import redis

    from batchgen.config import get_settings

    marker = "batchgen-test-marker"
    client = get_redis()
    # MONITOR on a client of its own: taken from the action's pool, it could leave the
    # action a new connection to open (HELLO, PING), which is not the hot path's.
    watcher = redis.Redis.from_url(get_settings().redis.url)
    with watcher.monitor() as monitor:
        result = action()
        client.echo(marker)
        sent: list[str] = []
        while True:
            command = monitor.next_command()
            if marker in command["command"]:
                return result, sent
            if command["client_type"] != "lua":
                sent.append(command["command"].split()[0].upper())


def test_a_synchronous_call_takes_the_next_free_slot_before_other_work(clean_db):
    """Every slot held: a call denied a slot claims the next one; when one frees, other
    work is denied it while the claim lasts, and the call gets it. A claim lapses by
    itself once its caller stops trying."""
    from batchgen.limits.gate import URGENT_CLAIM_S, Gate, Pass, Wait

    class Ticket:
        tenant_id, tenant_tokens_per_min, prompt_tokens_est, max_tokens = 1, None, 10, 10

        def __init__(self, item_id: int, urgent: bool = False) -> None:
            self.item_id, self.attempt, self.urgent = item_id, 1, urgent

    # The claims alone: no reserve of slots for calls (tests/integration/test_call_reserve.py).
    gate = Gate(get_redis(), Settings(slot_wait_s=0.0, call_reserved_slots=0))
    s = spec(tpm=1_000_000, rpm=1000, key="urgent")  # two slots
    first, second = gate.enter(s, Ticket(1)), gate.enter(s, Ticket(2))
    assert isinstance(first, Pass) and isinstance(second, Pass)
    assert isinstance(gate.enter(s, Ticket(9, urgent=True)), Wait)  # denied: it claims
    gate.settle(s, first, 1, 10)  # a slot frees...
    assert isinstance(gate.enter(s, Ticket(3)), Wait)  # ...not for other work
    call = gate.enter(s, Ticket(9, urgent=True))
    assert isinstance(call, Pass)  # ...but for the call
    gate.settle(s, second, 1, 10)
    bulk = gate.enter(s, Ticket(3))
    assert isinstance(bulk, Pass)  # the claim ended with the call's entry

    gate.settle(s, call, 1, 10)
    gate.settle(s, bulk, 1, 10)
    held = [gate.enter(s, Ticket(4)), gate.enter(s, Ticket(5))]
    assert isinstance(gate.enter(s, Ticket(8, urgent=True)), Wait)  # claims, then goes away
    gate.settle(s, held[0], 1, 10)  # type: ignore[arg-type]
    assert isinstance(gate.enter(s, Ticket(6)), Wait)
    hold(URGENT_CLAIM_S + 0.1, "the call's claim outlives its time")
    assert isinstance(gate.enter(s, Ticket(6)), Pass)  # the claim lapsed
