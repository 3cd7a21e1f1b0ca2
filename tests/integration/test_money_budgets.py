"""Dollar budgets on real PostgreSQL and Redis (docs/money.md): the dispatcher reserves
each item's worst case at its route's tier and holds a tenant its budget cannot cover
(its items stay pending, unbilled, until the period rolls or the limit is raised); a
rebuild from the ledger settles what ended; a synchronous call over budget gets 429
``budget_exhausted`` with the reset; each threshold alerts once per period.

The dispatcher runs in the test's process (``release_model``, as in test_fair_order):
where workers would finish items, the test ledgers and finishes them itself. The
clock of the budgets' periods is injected (``batchgen.worker.money_holds._now``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from collections.abc import Iterator
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import func, select, text, update

from batchgen import python_api as client
from batchgen import tenant_admin
from batchgen.config import get_settings
from batchgen.domain.billing import budget_maths as rules
from batchgen.limits.backend import get_redis
from batchgen.limits.money_budgets import MoneyBudgets
from batchgen.limits.redis_keys import money as money_key
from batchgen.registry import Tier, get_registry
from batchgen.store import budget_rows as money_store
from batchgen.store import db, items, tenants
from batchgen.store.ledger import CallOutcome, Ledgered, price, record_waste
from batchgen.store.schema import BudgetHold, Item
from batchgen.worker import money_alerts, money_settle
from batchgen.worker import money_holds as money
from batchgen.worker.dispatch import release_model
from tests import http_client
from tests.helpers import chat_line, make_tenant
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = "sim-small"
NOW = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.UTC)
TODAY, TOMORROW = f"d{NOW:%Y%m%d}", f"d{NOW + dt.timedelta(days=1):%Y%m%d}"
CLOCK = [NOW]  # the budgets' now, and the time the test's ledger rows are written at


@pytest.fixture
def clock(clean_db, monkeypatch) -> Iterator[list[dt.datetime]]:
    """The budgets' clock: ``clock[0]`` is now (move it to roll a period). Holds last
    a tenth of a second, so a test's next release finds the tenant again. The test's
    ledger rows are written at this clock too, never at the database's own time, so a
    run crossing midnight keeps them in the test's period."""
    now = CLOCK
    now[0] = NOW
    monkeypatch.setattr(money, "_now", lambda: now[0])
    monkeypatch.setitem(os.environ, "BATCHGEN_MONEY_HOLD_S", "0.1")
    get_settings.cache_clear()
    yield now
    get_settings.cache_clear()


def spec():
    return get_registry()[MODEL]


def worst(max_tokens: int, prompt_est: int, tier: Tier = Tier.STANDARD) -> int:
    return rules.worst_case_micros(spec(), prompt_est, max_tokens, tier)


def submit(tenant: str, n: int, max_tokens: int = 100) -> str:
    rows = [chat_line(f"r{i}", model=MODEL, max_tokens=max_tokens) for i in range(n)]
    return str(client.submit_batch(rows, tenant=tenant, priority="interactive")["id"])


def release() -> list[int]:
    with db.session_scope() as session:
        return [r.item_id for r in release_model(session, spec(), get_settings())]


def released_when_free() -> list[int]:
    """Release once the tenant's hold (0.1 s) has passed."""

    def passed() -> bool:
        with db.session_scope() as session:
            held = session.scalar(
                select(func.count())
                .select_from(BudgetHold)
                .where(BudgetHold.held_until > func.now())
            )
        return not held

    wait_until(passed, 4, "the tenant's hold to pass", poll_s=0.02)
    return release()


def item_facts(batch_id: str) -> list[tuple[int, str, int, int]]:
    with db.session_scope() as session:
        rows = session.execute(
            select(Item.id, Item.status, Item.prompt_tokens_est, Item.max_tokens)
            .where(Item.batch_id == batch_id)
            .order_by(Item.id)
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def finish_with_cost(item_ids: list[int], cost_usd: Decimal, at: dt.datetime | None = None) -> None:
    """As a worker would: each item succeeded and its call ledgered at ``cost_usd``, at
    the budgets' clock unless ``at`` says otherwise."""
    at = at or CLOCK[0]
    with db.session_scope() as session:
        for item_id in item_ids:
            session.execute(
                text(
                    "INSERT INTO usage_ledger (item_id, attempt, tenant_id, batch_id, model, "
                    "prompt_tokens, completion_tokens, cost_usd, created_at) "
                    "SELECT id, attempts + 1, tenant_id, batch_id, model, prompt_tokens_est, "
                    "max_tokens, :cost, :at FROM items WHERE id = :id"
                ),
                {"id": item_id, "cost": cost_usd, "at": at},
            )
        session.execute(
            update(Item)
            .where(Item.id.in_(item_ids))
            .values(status="succeeded", started_at=func.now(), finished_at=func.now())
        )


def level(tenant: str) -> dict:
    (found,) = [b for b in tenant_admin.get_budgets(tenant) if b["key_id"] is None]
    return found


def statuses(batch_id: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, status, _, _ in item_facts(batch_id):
        counts[status] = counts.get(status, 0) + 1
    return counts


def test_items_reserve_their_worst_case_at_their_routes_tier(clock):
    make_tenant("acme")
    batch = submit("acme", 6)
    facts = item_facts(batch)
    routes = ["standard", "standard", "flex", "flex", "batch", "batch"]
    with db.session_scope() as session:
        for (item_id, *_), route in zip(facts, routes, strict=True):
            session.execute(update(Item).where(Item.id == item_id).values(route=route))
    tenant_admin.set_budget("acme", limit_usd="10", period="day")
    released = release()
    assert sorted(released) == [f[0] for f in facts]
    tier = {"standard": Tier.STANDARD, "flex": Tier.FLEX, "batch": Tier.BATCH}
    expected = sum(
        worst(mt, est, tier[r]) for (_, _, est, mt), r in zip(facts, routes, strict=True)
    )
    assert worst(100, facts[0][2], Tier.FLEX) * 2 == worst(100, facts[0][2])  # half price
    state = level("acme")
    assert (state["used_micros"], state["reserved_micros"]) == (0, expected)

    # Settled from the ledger: each at its actual price, nothing left reserved.
    finish_with_cost([f[0] for f in facts], Decimal("0.000123"))
    state = level("acme")
    assert (state["used_micros"], state["reserved_micros"]) == (6 * 123, 0)
    # Settling again changes nothing (each reservation once).
    assert (level("acme")["used_micros"], level("acme")["reserved_micros"]) == (738, 0)


def raw_level(tenant: str) -> tuple[int, int]:
    """What Redis holds for the tenant's budget now (no rebuild): used, reserved."""
    with db.session_scope() as session:
        tenant_id = tenants.find(session, tenant).id
        (budget,) = [b for b in money_store.budgets_of(session, [tenant_id])[tenant_id]]
    win = rules.window(budget.rule.period, budget.rule.time_zone, money._now())
    found = MoneyBudgets(get_redis()).level(money_key(tenant_id, budget.id, win.key))
    assert found is not None
    return found.used_micros, found.reserved_micros


def test_each_ledger_write_settles_its_reservation_once(clock):
    make_tenant("acme")
    batch = submit("acme", 2)
    tenant_admin.set_budget("acme", limit_usd="10", period="day")
    assert len(release()) == 2
    (first, _, est, max_tokens), _ = item_facts(batch)
    assert raw_level("acme") == (0, 2 * worst(max_tokens, est))
    outcome = CallOutcome(item_id=first, attempt=1, prompt_tokens=est, completion_tokens=7)
    with db.session_scope() as session:
        record_waste(session, outcome, spec(), "cancelled_mid_call")
    cost = rules.to_micros(price(outcome, spec()).cost)
    # Released and its price applied as the row committed, not by a rebuild.
    assert raw_level("acme") == (cost, worst(max_tokens, est))
    again = Ledgered(tenant_of(first), first, 1, price(outcome, spec()).cost)
    assert money_settle.settle([again]) == 0  # once: a second settle is a no-op
    assert raw_level("acme") == (cost, worst(max_tokens, est))


def tenant_of(item_id: int) -> int:
    with db.session_scope() as session:
        return int(session.get(Item, item_id).tenant_id)  # type: ignore[union-attr]


def test_a_sync_call_settles_its_reservation_when_ledgered(clean_db, simulator):
    make_tenant("acme")
    tenant_admin.set_budget("acme", limit_usd="10", period="total")
    line = chat_line("call", model=MODEL, max_tokens=20)
    start = {"tenant": "acme", "endpoint": "/v1/chat/completions", "deadline_s": 60}
    assert client.wait_call(client.start_call(line, **start)).response is not None
    with db.session_scope() as session:
        spent = session.scalar(text("SELECT sum(cost_usd) FROM usage_ledger"))
    # Its reservation moved to its item's id and settled at the ledger's price.
    assert raw_level("acme") == (rules.to_micros(spent), 0)


def test_a_tenant_over_budget_is_held_not_failed_and_resumes_when_the_period_rolls(clock):
    make_tenant("acme")
    make_tenant("globex")
    batch = submit("acme", 10)
    other = submit("globex", 4)
    facts = item_facts(batch)
    one = worst(facts[0][3], facts[0][2])
    tenant_admin.set_budget("acme", limit_usd=rules.to_usd(3 * one), period="day")

    released = release()
    assert statuses(batch) == {"queued": 3, "pending": 7}
    assert statuses(other) == {"queued": 4}  # the other tenant is not held
    assert len(released) == 7
    with db.session_scope() as session:
        assert session.scalar(select(func.count()).select_from(BudgetHold)) == 1

    # The three are billed their worst case: the day's budget is spent.
    queued = [f[0] for f in item_facts(batch) if f[1] == "queued"]
    finish_with_cost(queued, rules.to_usd(one))
    assert released_when_free() == []
    assert statuses(batch) == {"succeeded": 3, "pending": 7}  # held: not failed

    # The next day (UTC) the budget starts again.
    clock[0] = NOW + dt.timedelta(days=1)
    assert len(released_when_free()) == 3
    assert statuses(batch) == {"succeeded": 3, "queued": 3, "pending": 4}


def test_items_still_held_at_their_deadline_end_failed_budget_exhausted(clock):
    make_tenant("acme")
    batch = submit("acme", 4)
    (_, _, est, max_tokens), *_ = item_facts(batch)
    tenant_admin.set_budget("acme", limit_usd=rules.to_usd(worst(max_tokens, est)), period="day")
    assert len(release()) == 1
    with db.session_scope() as session:
        session.execute(update(Item).where(Item.batch_id == batch).values(deadline_at=func.now()))
    with db.session_scope() as session:
        items.sweep_expire(session)
        ends = session.execute(
            select(Item.status, Item.error_code).where(Item.batch_id == batch)
        ).all()
    # The one released (queued, not held) expires; the held ones fail, never billed.
    assert (
        sorted(map(tuple, ends)) == [("expired", "expired")] + [("failed", "budget_exhausted")] * 3
    )


def test_raising_the_limit_releases_held_items(clock):
    make_tenant("acme")
    batch = submit("acme", 5)
    facts = item_facts(batch)
    one = worst(facts[0][3], facts[0][2])
    tenant_admin.set_budget("acme", limit_usd=rules.to_usd(2 * one), period="month")
    assert len(release()) == 2
    assert released_when_free() == []
    tenant_admin.set_budget("acme", limit_usd=rules.to_usd(4 * one), period="month")
    assert len(released_when_free()) == 2
    assert statuses(batch) == {"queued": 4, "pending": 1}


def test_a_key_budget_holds_that_keys_batches_only(clock):
    make_tenant("acme")
    nightly = tenant_admin.create_key("acme", name="nightly", scopes=["batches"])
    capped = submit("acme", 4)
    free = submit("acme", 4)
    with db.session_scope() as session:
        session.execute(
            text("UPDATE batches SET key_id = :k WHERE id = :b"), {"k": nightly["id"], "b": capped}
        )
    facts = item_facts(capped)
    one = worst(facts[0][3], facts[0][2])
    tenant_admin.set_budget("acme", key_id=nightly["id"], limit_usd=rules.to_usd(one), period="day")
    release()
    assert statuses(capped) == {"queued": 1, "pending": 3}
    assert statuses(free) == {"queued": 4}


def test_redis_losing_its_data_is_rebuilt_from_the_ledger_and_what_is_in_flight(clock):
    make_tenant("acme")
    batch = submit("acme", 6)
    facts = item_facts(batch)
    one = worst(facts[0][3], facts[0][2])
    tenant_admin.set_budget("acme", limit_usd=rules.to_usd(4 * one), period="day")
    assert len(release()) == 4
    finish_with_cost([facts[0][0]], rules.to_usd(one))  # one billed, three in flight
    get_redis().flushdb()
    # Nothing more fits: 1 spent + 3 in flight, rebuilt conservatively.
    assert released_when_free() == []
    state = level("acme")
    assert (state["used_micros"], state["reserved_micros"]) == (one, 3 * one)


def test_each_threshold_alerts_once_per_period(clock):
    make_tenant("acme")
    batch = submit("acme", 10)
    ids = [f[0] for f in item_facts(batch)]
    tenant_admin.set_budget("acme", limit_usd="1", period="day", thresholds=[50, 80, 100])
    alerts: list[tuple[str, int]] = []
    hook = money_alerts.on_alert(lambda a: alerts.append((a.period_key, a.threshold_pct)))
    try:
        finish_with_cost(ids[:6], Decimal("0.1"))  # $0.60
        level("acme")
        level("acme")
        assert alerts == [(TODAY, 50)]
        finish_with_cost(ids[6:9], Decimal("0.15"))  # $1.05
        level("acme")
        assert alerts == [(TODAY, 50), (TODAY, 80), (TODAY, 100)]
        clock[0] = NOW + dt.timedelta(days=1)  # the ledger's rows are today's: nothing
        level("acme")
        assert len(alerts) == 3
        finish_with_cost(ids[9:], Decimal("0.5"), at=clock[0])
        level("acme")
        assert alerts[3:] == [(TOMORROW, 50)]
    finally:
        money_alerts.remove_hook(hook)


def test_a_sync_call_over_budget_gets_429_with_the_reset(clean_db, module_api_server):
    key = make_tenant("acme")
    tenant_admin.set_budget("acme", limit_usd="0.000001", period="day", time_zone="Europe/Paris")
    base_url = module_api_server()
    answer = http_client.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert answer.status_code == 429, answer.text
    error = answer.json()["error"]
    assert error["code"] == "budget_exhausted"
    resets = dt.datetime.fromisoformat(error["resets_at"])
    now = dt.datetime.now(dt.UTC)
    assert now < resets <= now + dt.timedelta(days=1)
    assert resets.astimezone(rules.zone("Europe/Paris")).time() == dt.time(0, 0)
    assert 0 < int(answer.headers["Retry-After"]) <= 86_400
    with db.session_scope() as session:  # nothing stored, nothing billed
        assert session.scalar(select(func.count()).select_from(Item)) == 0


def test_budgets_are_set_over_the_admin_api_and_audited(clean_db, module_api_server):
    import hashlib

    make_tenant("acme")
    operator = "op-secret"
    digest = hashlib.sha256(operator.encode()).hexdigest()
    base_url = module_api_server(env={"BATCHGEN_ADMIN_KEYS": f'["ops:{digest}"]'})
    with httpx.Client(base_url=base_url, timeout=30) as api:
        auth = {"Authorization": f"Bearer {operator}"}
        put = api.put(
            "/admin/v1/tenants/acme/budget",
            json={"limit_usd": "12.5", "period": "month", "time_zone": "Asia/Tokyo"},
            headers=auth,
        )
        assert put.status_code == 200, put.text
        assert put.json()["limit_micros"] == 12_500_000
        listed = api.get("/admin/v1/tenants/acme/budgets", headers=auth).json()["data"]
        assert [(b["period"], b["time_zone"], b["used_micros"]) for b in listed] == [
            ("month", "Asia/Tokyo", 0)
        ]
        bad = api.put(
            "/admin/v1/tenants/acme/budget", json={"limit_usd": 1, "period": "week"}, headers=auth
        )
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "period")
    actions = [e["action"] for e in tenant_admin.audit_log(tenant="acme")]
    assert "budget.set" in actions


def test_alerts_go_to_the_tenants_and_the_operators_webhooks_signed(clock, monkeypatch):
    from batchgen.domain.notifications import verify
    from batchgen.store import tenants
    from tests.integration.test_notifications import Receiver

    tenant_hook, operator_hook = Receiver(failures=0), Receiver(failures=1)
    operator_secret = tenants.new_webhook_secret()
    monkeypatch.setitem(os.environ, "BATCHGEN_WEBHOOK_ALLOW_NETS", '["127.0.0.0/8"]')
    monkeypatch.setitem(os.environ, "BATCHGEN_MONEY_WEBHOOK_URL", operator_hook.url)
    monkeypatch.setitem(os.environ, "BATCHGEN_MONEY_WEBHOOK_SECRET", operator_secret)
    monkeypatch.setattr(money_alerts, "RETRY_FIRST_S", 0.05)
    get_settings.cache_clear()
    try:
        make_tenant("acme")
        with db.session_scope() as session:
            _, tenant_secret = tenants.set_webhook(session, "acme", tenant_hook.url)
        batch = submit("acme", 2)
        tenant_admin.set_budget("acme", limit_usd="1", period="day", thresholds=[80])
        finish_with_cost([f[0] for f in item_facts(batch)], Decimal("0.45"))
        level("acme")
        level("acme")  # once per threshold and period
        wait_until(
            lambda: tenant_hook.accepted() and operator_hook.accepted(),
            30,
            "both webhooks accepted",
            poll_s=0.05,
        )
        for hook, secret in ((tenant_hook, tenant_secret), (operator_hook, operator_secret)):
            (headers, body, _), *more = hook.accepted()
            assert more == []
            lowered = {k.lower(): v for k, v in headers.items()}
            assert verify(secret, lowered, body, time.time())
            event = json.loads(body)
            assert event["type"] == "budget.threshold"
            assert (event["tenant"], event["threshold_pct"], event["used_usd"]) == (
                "acme",
                80,
                "0.9",
            )
            assert event["resets_at"] == f"{NOW.date() + dt.timedelta(days=1)}T00:00:00+00:00"
        assert len(operator_hook.requests) == 2  # one 500, then delivered
    finally:
        for hook in (tenant_hook, operator_hook):
            hook.server.shutdown()
            hook.server.server_close()


def test_the_budget_gauges_show_used_reserved_and_limit(clean_db):
    from batchgen.monitoring.metrics import StateCollector, render

    make_tenant("acme")
    batch = submit("acme", 3)
    facts = item_facts(batch)
    tenant_admin.set_budget("acme", limit_usd="2", period="total")
    release()  # three reserved
    finish_with_cost([facts[0][0]], Decimal("0.25"))  # one settled
    state = level("acme")
    collector = StateCollector(db.session_scope, get_redis(), get_registry(), get_settings())
    text_out = render(collector).decode()
    labels = 'budget="1",key="",period="total",tenant="acme"'
    assert f"batchgen_budget_usd_limit{{{labels}}} 2.0" in text_out
    assert f"batchgen_budget_usd_used{{{labels}}} 0.25" in text_out
    reserved = state["reserved_micros"] / 1_000_000
    assert reserved == 2 * worst(facts[1][3], facts[1][2]) / 1_000_000
    assert f"batchgen_budget_usd_reserved{{{labels}}} {reserved}" in text_out


def test_real_workers_never_pass_a_budget_and_finish_once_it_is_raised(
    clean_db, simulator, workers
):
    """A worker process (its dispatcher, refills and calls) runs a tenant's batch
    against a budget that covers part of it: the ledger never passes the budget, the
    rest waits pending (not failed); raised, the batch finishes and nothing stays
    reserved once settled."""
    make_tenant("acme")
    batch = submit("acme", 12, max_tokens=40)
    facts = item_facts(batch)
    one = worst(facts[0][3], facts[0][2])
    limit = 5 * one
    tenant_admin.set_budget("acme", limit_usd=rules.to_usd(limit), period="total")
    workers(concurrency=4, env={"BATCHGEN_MONEY_HOLD_S": "0.2"})

    def spent_micros() -> int:
        with db.session_scope() as session:
            total = session.scalar(text("SELECT coalesce(sum(cost_usd), 0) FROM usage_ledger"))
        return rules.to_micros(total)

    def settled_down() -> bool:
        counts = statuses(batch)
        return counts.get("succeeded", 0) >= 5 and not {"queued", "running"} & set(counts)

    wait_until(settled_down, 120, lambda: f"the budget's items to settle: {statuses(batch)}")
    # The simulator bills less than the worst case: more than 5 may fit, never all.
    counts = statuses(batch)
    assert counts.get("failed", 0) == 0 and counts.get("pending", 0) > 0, counts
    assert spent_micros() <= limit

    tenant_admin.set_budget("acme", limit_usd="10", period="total")
    wait_until(
        lambda: statuses(batch) == {"succeeded": 12},
        120,
        lambda: f"every item to succeed: {statuses(batch)}",
    )
    state = level("acme")
    assert (state["used_micros"], state["reserved_micros"]) == (spent_micros(), 0)


def test_the_key_lookup_says_whether_a_budget_applies(clean_db):
    """Read in the key's own lookup: a call with no budget reads nothing more."""
    from batchgen.store.api_keys import authenticate

    secret = make_tenant("acme")
    other = tenant_admin.create_key("acme", name="other", scopes=["calls"])

    def applies() -> tuple[bool, bool]:
        with db.session_scope() as session:
            return (
                authenticate(session, secret).has_budget,
                authenticate(session, other["secret"]).has_budget,
            )

    assert applies() == (False, False)
    tenant_admin.set_budget("acme", key_id=other["id"], limit_usd="1", period="day")
    assert applies() == (False, True)  # a key's budget is that key's only
    tenant_admin.set_budget("acme", limit_usd="1", period="day")
    assert applies() == (True, True)
