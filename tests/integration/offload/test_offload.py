"""Offloading bulk work to the providers' own Batch APIs (app/worker/offload_jobs.py):
routes, pricing, bounds, the API and metrics, on real PostgreSQL and the simulator's
batch APIs over HTTP (tests/integration/offload/support.py has the setup)."""

from __future__ import annotations

import os
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import func, select

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.registry import get_registry, load_registry
from batchgen.store import db
from batchgen.store.schema import Item, Result, UsageLedger
from batchgen.worker.offload_jobs import tick
from tests import http_client
from tests.helpers import (
    assert_daily_usage_matches_ledger,
    assert_ledger_is_results_plus_waste,
    chat_line,
    make_tenant,
    sim_config,
    wait_batches,
)
from tests.integration.offload.support import (
    MODELS,
    finished,
    jobs_of,
    ledger_by_route,
    provider_jobs_at_simulator,
    statuses,
    submit,
    ticks_until,
)


@pytest.mark.parametrize("model", MODELS)
def test_a_bulk_batch_is_offloaded_and_recorded_at_the_batch_price(offloading, simulator, model):
    offloading()
    tenant = f"offload-all-{model}"
    make_tenant(tenant)
    batch_id = submit(tenant, 6, model)
    assert statuses(batch_id) == {"offloaded": 6}
    ticks_until(lambda: finished(batch_id))

    assert statuses(batch_id) == {"succeeded": 6}
    assert ledger_by_route(batch_id) == {("offline", False): 6}
    (job,) = jobs_of(batch_id)
    assert (job.status, job.item_count, job.provider_job_id is not None) == ("ended", 6, True)
    assert len(provider_jobs_at_simulator(simulator, model)) >= 1
    spec = get_registry()[model]
    batch_prices = spec.offline_prices()
    with db.session_scope() as session:
        rows = session.execute(
            select(
                UsageLedger.prompt_tokens,
                UsageLedger.completion_tokens,
                UsageLedger.cost_usd,
                UsageLedger.online_cost_usd,
            ).where(UsageLedger.batch_id == batch_id)
        ).all()
        result_cost = session.scalar(
            select(func.sum(Result.cost_usd)).where(Result.batch_id == batch_id)
        )
    million = Decimal(1_000_000)
    for prompt, completion, cost, online_cost in rows:
        assert prompt > 0 and completion > 0
        expected = (
            prompt * Decimal(str(batch_prices.input_usd_per_1m))
            + completion * Decimal(str(batch_prices.output_usd_per_1m))
        ) / million
        assert cost == expected
        assert online_cost == 2 * cost  # the shipped route: half the online prices
    assert result_cost == sum(r[2] for r in rows)
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()
    # The results read as any batch's, in the OpenAI output format.
    results = list(client.iter_results(batch_id, tenant=tenant))
    assert [r["response"]["status_code"] for r in results] == [200] * 6


def test_a_gemini_job_over_the_inline_bound_goes_as_a_file(offloading, simulator):
    offloading(extra="inline_max_bytes = 1")  # every job is "large": a file
    tenant = "offload-gemini-file"
    make_tenant(tenant)
    batch_id = submit(tenant, 3, "sim-gemini")
    ticks_until(lambda: finished(batch_id))
    assert statuses(batch_id) == {"succeeded": 3}
    assert ledger_by_route(batch_id) == {("offline", False): 3}
    sent = http_client.get(
        f"{simulator.base_url}/_sim/last_request", params={"api": "gemini_batch"}
    )
    source = sent.json()["batch"]["inputConfig"]
    assert source["fileName"].startswith("files/") and "requests" not in source
    with db.session_scope() as session:
        costs = session.execute(
            select(UsageLedger.cost_usd, UsageLedger.online_cost_usd).where(
                UsageLedger.batch_id == batch_id
            )
        ).all()
    assert len(costs) == 3 and all(cost > 0 and online == 2 * cost for cost, online in costs)
    results = list(client.iter_results(batch_id, tenant=tenant))
    assert [r["response"]["body"]["object"] for r in results] == ["chat.completion"] * 3


@pytest.mark.slow
def test_near_deadlines_run_online_and_the_rest_offline(offloading, simulator, workers):
    env = offloading()
    tenant = "offload-mixed"
    make_tenant(tenant)
    lines = [chat_line(f"far-{i}") for i in range(4)]
    # A per-item deadline of 30 s leaves no room for a job expected within 60 s.
    lines += [{**chat_line(f"near-{i}"), "timeout": "30s"} for i in range(3)]
    batch_id = submit(tenant, 0, "sim-small", lines=lines)
    assert statuses(batch_id) == {"offloaded": 4, "pending": 3}
    # An interactive batch and one that says never stay online whatever their window.
    interactive = submit(tenant, 2, "sim-small", priority="interactive")
    never = submit(tenant, 2, "sim-small", offload="never")
    assert statuses(interactive) == {"pending": 2} and statuses(never) == {"pending": 2}
    workers(env=env, beat=True)
    wait_batches([interactive, never], timeout_s=60)
    ticks_until(lambda: finished(batch_id))

    assert statuses(batch_id) == {"succeeded": 7}
    assert ledger_by_route(batch_id) == {("offline", False): 4, ("online", False): 3}
    with db.session_scope() as session:
        offline_ids = set(
            session.scalars(
                select(Item.custom_id).where(Item.batch_id == batch_id, Item.job_id.is_not(None))
            )
        )
    assert offline_ids == {f"far-{i}" for i in range(4)}
    assert ledger_by_route(interactive) == {("online", False): 2}
    assert_ledger_is_results_plus_waste()


def test_always_needs_a_model_that_offloads(offloading):
    offloading()
    tenant = "offload-always-bad"
    make_tenant(tenant)
    from batchgen.errors import ValidationFailed

    with pytest.raises(ValidationFailed, match="'sim-large' has no offline route"):
        submit(tenant, 2, "sim-large", offload="always")
    with pytest.raises(ValidationFailed, match="offload must be one of"):
        submit(tenant, 2, "sim-small", offload="sometimes")
    with db.session_scope() as session:
        assert not session.scalar(
            select(func.count()).select_from(Item).where(Item.custom_id.like(f"{tenant}-%"))
        )


def test_the_enqueued_token_limit_is_respected(offloading, simulator):
    # Three items per job; the provider (and our registry) allow one job's tokens at a time.
    env = offloading(max_requests=3)
    tenant = "offload-enqueued"
    make_tenant(tenant)
    batch_id = submit(tenant, 9, "sim-small")
    with db.session_scope() as session:
        per_item = session.scalar(
            select(func.max(Item.prompt_tokens_est + Item.max_tokens)).where(
                Item.batch_id == batch_id
            )
        )
    limit = int(per_item * 3.5)  # room for one job of three at a time
    sim_config(simulator.base_url, batch_enqueued_tokens_limit=limit, batch_turnaround_s=0.5)
    offloading(max_requests=3, extra=f"enqueued_tokens = {limit}")
    del env
    reports = ticks_until(lambda: finished(batch_id))

    assert statuses(batch_id) == {"succeeded": 9}
    jobs = jobs_of(batch_id)
    assert [j.status for j in jobs] == ["ended"] * 3
    assert max(r.created for r in reports) == 1  # never two jobs in one tick
    assert all(j.enqueued_tokens <= limit for j in jobs)
    # The provider refused none: never more than the limit enqueued at once.
    at_provider = provider_jobs_at_simulator(simulator, "sim-small")
    ours = [j for j in at_provider if j.id in {job.provider_job_id for job in jobs}]
    assert len(ours) == 3 and all(j.status == "completed" for j in ours)
    spans = sorted((j.created_at, j.completed_at) for j in ours)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:], strict=False))


def test_status_metrics_and_usage_show_routes_jobs_and_savings(offloading, simulator):
    from batchgen.limits.backend import get_redis
    from batchgen.monitoring.metrics import StateCollector, render
    from batchgen.monitoring.snapshot import snapshot

    offloading()
    sim_config(simulator.base_url, batch_turnaround_s=1.5)
    tenant = "offload-visible"
    make_tenant(tenant)
    batch_id = submit(tenant, 4, "sim-small")
    tick(get_registry(), get_settings())
    with db.session_scope() as session:
        during = snapshot(session, get_redis(), get_registry(), get_settings())
    (small,) = [m for m in during["models"] if m["model"] == "sim-small"]
    assert small["offloaded"] == 4 and small["pending"] == 0
    assert [(j["model"], j["open"], j["items"]) for j in during["provider_jobs"]] == [
        ("sim-small", 1, 4)
    ]
    assert during["provider_jobs"][0]["oldest_age_s"] >= 0
    collector = StateCollector(db.session_scope, get_redis(), get_registry(), get_settings())
    text = render(collector).decode()
    assert 'batchgen_provider_jobs_open{model="sim-small"} 1.0' in text
    assert 'batchgen_items{model="sim-small",status="offloaded"} 4.0' in text
    ticks_until(lambda: finished(batch_id))

    with db.session_scope() as session:
        after = snapshot(session, get_redis(), get_registry(), get_settings())
        online_cost, cost = session.execute(
            select(func.sum(UsageLedger.online_cost_usd), func.sum(UsageLedger.cost_usd)).where(
                UsageLedger.batch_id == batch_id
            )
        ).one()
    assert after["provider_jobs"] == []
    assert after["routes_today"]["offline"]["requests"] == 4
    assert after["routes_today"]["online"]["requests"] == 0
    assert Decimal(after["saved_today_usd"]) == online_cost - cost > 0
    (row,) = client.usage(tenant=tenant)
    assert (row["requests"], row["offline_requests"]) == (4, 4)
    assert Decimal(row["saved_usd"]) == online_cost - cost
    assert Decimal(row["offline_cost_usd"]) == Decimal(row["cost_usd"]) == cost
    text = render(collector).decode()
    assert 'batchgen_route_requests_total{route="offline"} 4.0' in text
    assert f"batchgen_offline_saved_usd_total {float(online_cost - cost)}" in text


def test_a_nightly_job_offloads_by_default(offloading, tmp_path):
    import datetime as dt

    from batchgen.nightly.jobs import Job
    from batchgen.nightly.runs import submit_job

    offloading()
    make_tenant("shop")
    catalog = tmp_path / "catalog.csv"
    catalog.write_text("id,name\n" + "".join(f"p{i},Product {i}\n" for i in range(5)))

    def run(**kw: Any) -> str:
        name = f"descriptions-{len(kw)}"
        job = Job(
            name=name,
            tenant="shop",
            model="sim-small",
            catalog=catalog,
            output=tmp_path / f"{name}.jsonl",
            **kw,
        )
        assert job.offload.value == kw.get("offload", "auto")
        (batch_id,), _ = submit_job(job, dt.date(2026, 12, 1))
        return batch_id

    assert statuses(run()) == {"offloaded": 5}  # bulk, a 24 h window: offloaded
    assert statuses(run(offload="never")) == {"pending": 5}


def test_the_http_api_takes_offload_and_offloaded_work_is_not_the_online_backlog(offloading):
    from batchgen.api import create_app
    from tests.helpers import jsonl

    offloading()
    # A backlog bound of ~200 tokens for sim-small: six items are over it online.
    os.environ["BATCHGEN_MAX_BACKLOG_MIN"] = "0.0001"
    get_settings.cache_clear()
    key = make_tenant("offload-http")
    api = create_app().test_client()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/jsonl"}
    body = jsonl([chat_line(f"h-{i}") for i in range(6)])

    online = api.post("/v1/batches?priority=bulk&offload=never", data=body, headers=headers)
    assert online.status_code == 413, online.get_json()
    offline = api.post("/v1/batches?priority=bulk", data=body, headers=headers)
    assert offline.status_code == 200, offline.get_json()
    described = offline.get_json()
    assert described["offload"] == "auto" and described["request_counts"]["offloaded"] == 6
    bad = api.post("/v1/batches?priority=bulk&offload=half", data=body, headers=headers)
    assert bad.status_code == 400 and "offload must be one of" in bad.get_json()["error"]["message"]
    anthropic_body = {
        "requests": [
            {
                "custom_id": "m-1",
                "params": {
                    "model": "sim-claude",
                    "max_tokens": 20,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            }
        ],
        "priority": "bulk",
        "offload": "never",
    }
    created = api.post(
        "/v1/messages/batches", json=anthropic_body, headers={"Authorization": f"Bearer {key}"}
    )
    assert created.status_code == 200, created.get_json()
    assert statuses(client.get_batch(created.get_json()["id"], tenant="offload-http")["id"]) == {
        "pending": 1
    }


def test_offloaded_items_count_toward_the_tenants_open_items(offloading):
    from batchgen.errors import OverQuota

    offloading()
    make_tenant("offload-quota", max_pending_items=4)
    submit("offload-quota", 3, "sim-small")
    with pytest.raises(OverQuota, match="would have 6 open items"):
        submit("offload-quota", 3, "sim-small")


def test_items_waiting_on_a_model_that_stops_offloading_go_online(offloading):
    offloading()
    make_tenant("offload-off")
    batch_id = submit("offload-off", 3, "sim-small")
    assert statuses(batch_id) == {"offloaded": 3}
    os.environ.pop("BATCHGEN_MODELS_FILE")  # the shipped registry: nothing offloads
    get_settings.cache_clear()
    load_registry.cache_clear()
    report = tick(get_registry(), get_settings())

    assert report.returned == 3 and report.created == 0
    assert statuses(batch_id) == {"pending": 3}
    with db.session_scope() as session:
        codes = set(session.scalars(select(Item.error_code).where(Item.batch_id == batch_id)))
    assert codes == {"offload_turned_off"}
    assert jobs_of(batch_id) == []


LONG_SYSTEM = " ".join(f"Rule {i}: write plainly about the product." for i in range(300))


def test_an_anthropic_job_reads_the_prompt_cache_at_the_batch_price(offloading, simulator):
    """Rows sharing a long system prompt go to Anthropic's Batch API with a breakpoint;
    the provider's cache reads and writes reach the ledger, priced at the batch tier (the
    two discounts stack), for less than the same rows without the cache."""
    from batchgen.domain.billing.cost import TokenUsage, price_usage
    from batchgen.registry import Tier

    offloading()
    tenant = "offload-cached"
    make_tenant(tenant)
    lines = [
        chat_line(f"{tenant}-{i}", model="sim-claude")
        | {
            "body": {
                "model": "sim-claude",
                "max_tokens": 30,
                "messages": [
                    {"role": "system", "content": LONG_SYSTEM},
                    {"role": "user", "content": f"Describe product {i}."},
                ],
            }
        }
        for i in range(4)
    ]
    batch_id = submit(tenant, 4, "sim-claude", lines=lines)
    assert statuses(batch_id) == {"offloaded": 4}
    ticks_until(lambda: finished(batch_id))
    assert ledger_by_route(batch_id) == {("offline", False): 4}
    spec = get_registry()["sim-claude"]
    with db.session_scope() as session:
        rows = session.execute(
            select(
                UsageLedger.prompt_tokens,
                UsageLedger.completion_tokens,
                UsageLedger.cached_tokens,
                UsageLedger.cache_write_tokens,
                UsageLedger.cost_usd,
            ).where(UsageLedger.batch_id == batch_id)
        ).all()
    assert sum(r.cache_write_tokens for r in rows) >= 1024  # the first row wrote it
    assert sum(1 for r in rows if r.cached_tokens >= 1024) == 3  # the others read it
    for prompt, completion, cached, written, cost in rows:
        usage = TokenUsage(prompt, completion, cached, written)
        assert cost == price_usage(usage, spec, Tier.BATCH)
    uncached = sum(
        price_usage(TokenUsage(r.prompt_tokens, r.completion_tokens), spec, Tier.BATCH)
        for r in rows
    )
    assert sum(r.cost_usd for r in rows) < Decimal("0.5") * uncached
    assert_ledger_is_results_plus_waste()


def test_a_job_reserves_its_rows_and_one_that_would_overspend_is_not_created(offloading, simulator):
    from batchgen import tenant_admin
    from batchgen.domain.billing import budget_maths as rules
    from batchgen.limits.backend import get_redis
    from batchgen.limits.money_budgets import MoneyBudgets
    from batchgen.limits.redis_keys import money as money_key
    from batchgen.store import budget_rows as money_store
    from batchgen.store import tenants

    offloading()
    for name, limit in (("money-rich", "10"), ("money-poor", "0.000001")):
        make_tenant(name)
        tenant_admin.set_budget(name, limit_usd=limit, period="total")
    rich, poor = submit("money-rich", 3, "sim-small"), submit("money-poor", 3, "sim-small")
    ticks_until(lambda: finished(rich) and "offloaded" not in statuses(poor))
    assert statuses(rich) == {"succeeded": 3}
    assert statuses(poor) == {"pending": 3}  # back online, where its budget holds them
    assert [j.status for j in jobs_of(poor)] == ["failed"]  # never created at the provider
    with db.session_scope() as session:
        tenant_id = tenants.find(session, "money-rich").id
        (budget,) = money_store.budgets_of(session, [tenant_id])[tenant_id]
        spent = session.scalar(
            select(func.sum(UsageLedger.cost_usd)).where(UsageLedger.batch_id == rich)
        )
    level = MoneyBudgets(get_redis()).level(money_key(tenant_id, budget.id, "total"))
    assert level is not None and level.reserved_micros == 0  # each row settled as recorded
    assert 0 <= level.used_micros - rules.to_micros(spent) < 3  # each row rounded up
