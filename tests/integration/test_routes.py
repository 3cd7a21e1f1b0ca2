"""Routes by deadline and prompt caching end to end: real workers, the simulator over
HTTP. Flex calls are priced at the flex tier; a busy flex tier's refusals are waited
out without a cooldown or a failure attempt, and turn into standard calls in time when
the deadline nears; a prefix shared by a batch's Anthropic items is marked for the
provider's cache and read from it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal

import pytest
from sqlalchemy import func, select

from batchgen import python_api
from batchgen.domain.billing.cost import TokenUsage, price_usage
from batchgen.limits import counters
from batchgen.limits.backend import get_redis
from batchgen.registry import Tier, get_registry
from batchgen.simulator import SimulatorConfig, SimulatorThread
from batchgen.store import db
from batchgen.store.schema import Item, UsageLedger
from tests import http_client
from tests.env_vars import environment
from tests.helpers import chat_line, make_tenant, wait_batches

# Each flex model's route: a flex answer within a second, 3 s kept for a standard call.
FLEX = """latency_s = 1
timeout_s = 5
fallback_s = 3
retry_s = 0.2
retry_max_s = 0.4
max_refusals = 100
"""
MODELS = """
[models."flexy"]
provider = "openai"
base_url = "{base}/v1"
api_key_env = "ROUTES_KEY"
group = "routes"
budget_key = "flexy"
context_window = 16000
max_output_tokens = 200
tokens_per_min = 5000000
requests_per_min = 100000
max_concurrency = 8
input_usd_per_1m = 1.0
output_usd_per_1m = 4.0
call_timeout_s = 10

[models."flexy".flex]
{flex}
[models."gemflex"]
provider = "gemini"
base_url = "{base}"
api_key_env = "ROUTES_KEY"
group = "routes"
budget_key = "gemflex"
context_window = 1000000
max_output_tokens = 200
tokens_per_min = 5000000
requests_per_min = 100000
max_concurrency = 8
input_usd_per_1m = 0.3
output_usd_per_1m = 2.5
call_timeout_s = 10

[models."gemflex".flex]
{flex}
[models."claudy"]
provider = "anthropic"
base_url = "{base}"
api_key_env = "ROUTES_KEY"
group = "routes"
budget_key = "claudy"
context_window = 200000
max_output_tokens = 200
tokens_per_min = 5000000
requests_per_min = 100000
max_concurrency = 8
input_usd_per_1m = 3.0
output_usd_per_1m = 15.0
charge_policy = "actual"
"""
# Long enough to be cached (1024 tokens or more), as a nightly job's guidelines are.
GUIDE = "Write in the brand's calm voice; name the material; never promise delivery. " * 100


@pytest.fixture(scope="module")
def stack(services, module_workers, tmp_path_factory) -> Iterator[SimulatorThread]:
    """The simulator (flex three times slower) and a worker on a registry of a flex model
    and an Anthropic model."""
    config = SimulatorConfig(latency_base_ms=40, flex_latency_factor=3.0, seed=11)
    models = tmp_path_factory.mktemp("routes") / "models.toml"
    with SimulatorThread(config) as sim:
        models.write_text(MODELS.format(base=sim.base_url, flex=FLEX))
        env = {"BATCHGEN_MODELS_FILE": str(models), "ROUTES_KEY": "routes-key"}
        with environment(env):
            module_workers(["llm.routes", "batchgen.control"], concurrency=8, env=env)
            yield sim


def _sim(sim: SimulatorThread, **changes: object) -> dict:
    http_client.post(f"{sim.base_url}/_sim/reset").raise_for_status()
    http_client.post(f"{sim.base_url}/_sim/config", json=changes).raise_for_status()
    return changes


def _items(batch_id: str) -> list:
    with db.session_scope() as s:
        return s.execute(select(Item).where(Item.batch_id == batch_id)).scalars().all()


def _ledger(batch_id: str) -> list:
    with db.session_scope() as s:
        return (
            s.execute(select(UsageLedger).where(UsageLedger.batch_id == batch_id)).scalars().all()
        )


def _price(row: UsageLedger, tier: Tier, model: str = "flexy") -> Decimal:
    usage = TokenUsage(row.prompt_tokens, row.completion_tokens, row.cached_tokens)
    return price_usage(usage, get_registry()[model], tier)


def _bulk_flex(model: str, n: int) -> dict:
    """A bulk batch of ``n`` lines of ``model``, routed flex, run to its end."""
    rows = [chat_line(f"{model}{i}", model=model, max_tokens=40) for i in range(n)]
    bulk = python_api.submit_batch(rows, tenant="shop", completion_window="1h", priority="bulk")
    assert {i.route for i in _items(bulk["id"])} == {"flex"}
    wait_batches([bulk["id"]], timeout_s=120)
    return bulk


def _succeeded_without_failure_or_cooldown(items: list, model: str) -> None:
    """A refusal is no failure (every item on its first failure attempt) and no rate limit."""
    assert {i.status for i in items} == {"succeeded"}
    assert all(i.attempts - i.failovers == 1 and i.rate_limited == 0 for i in items)
    seen = counters.read(get_redis(), model)
    assert seen.get(counters.COOLDOWNS, 0) == 0 and seen.get(counters.RATE_LIMITED, 0) == 0


@pytest.mark.slow
def test_flex_calls_cost_half_and_a_busy_tier_falls_back_to_standard_in_time(clean_db, stack):
    make_tenant("shop")
    # A busy flex tier: two flex calls at a time, eight workers' threads asking.
    _sim(stack, flex_max_in_flight=2, flex_refusal_rate=0.0)
    bulk = _bulk_flex("flexy", 12)
    stats = http_client.get(f"{stack.base_url}/_sim/stats").json()["flex"]
    assert stats["refused"] > 0, "the flex tier must have been busy"
    items = _items(bulk["id"])
    assert sum(i.flex_refusals for i in items) == stats["refused"]
    _succeeded_without_failure_or_cooldown(items, "flexy")
    ledger = _ledger(bulk["id"])
    assert len(ledger) == 12 and {r.tier for r in ledger} == {"flex"}
    for row in ledger:  # priced at the flex tier: half the standard price
        assert row.cost_usd == _price(row, Tier.FLEX) == _price(row, Tier.STANDARD) / 2

    # Every flex call refused: the items wait for flex while the deadline leaves room for a
    # flex answer and the fallback (1 s + 3 s), then run standard, within their deadline.
    _sim(stack, flex_max_in_flight=None, flex_refusal_rate=1.0)
    rows = [chat_line(f"q{i}", model="flexy", max_tokens=40) for i in range(2)]
    near = python_api.submit_batch(rows, tenant="shop", completion_window=10, route="flex")
    assert {i.route for i in _items(near["id"])} == {"flex"}
    started = time.monotonic()
    wait_batches([near["id"]], timeout_s=60)
    assert time.monotonic() - started < 10
    items = _items(near["id"])
    assert {i.status for i in items} == {"succeeded"}
    assert all(i.finished_at < i.deadline_at for i in items)
    # Refused on flex, then run standard (how many flex tries fit before the fallback
    # depends on when each delivery started: on a loaded machine, one or none). The
    # calls' tiers say which route each took (the ledger, below, and the provider's
    # log): an item's route column is only what its next call would have asked for,
    # and a call once flex no longer fits goes standard whatever that says.
    assert sum(i.flex_refusals for i in items) >= 1
    assert all(i.attempts - i.failovers == 1 and i.rate_limited == 0 for i in items)
    ledger = _ledger(near["id"])
    assert len(ledger) == 2 and {r.tier for r in ledger} == {"standard"}
    assert all(r.cost_usd == _price(r, Tier.STANDARD) for r in ledger)
    log = http_client.get(f"{stack.base_url}/_sim/log").json()
    refused = [e for e in log if e["status"] == 429]
    assert refused and all(e["service_tier"] == "flex" for e in refused)
    # Flex first, then standard: an item's standard call starts after its refusals. How
    # long flex was tried is not fixed: a refusal's wait is drawn with jitter, and one
    # that would leave no room for another flex answer sends the item standard at once.
    for item in items:
        calls = [e for e in log if e.get("item") == str(item.id)]
        answered = [e["start_ts"] for e in calls if e["status"] == 200]
        assert len(answered) == 1, calls
        assert all(e["start_ts"] < answered[0] for e in calls if e["status"] == 429), calls
    _sim(stack, flex_refusal_rate=0.0)


def test_gemini_flex_calls_cost_half_and_its_shed_calls_wait_without_a_cooldown(clean_db, stack):
    make_tenant("shop")
    _sim(stack, flex_max_in_flight=1, flex_refusal_rate=0.0)
    bulk = _bulk_flex("gemflex", 4)
    items = _items(bulk["id"])
    _succeeded_without_failure_or_cooldown(items, "gemflex")
    log = http_client.get(f"{stack.base_url}/_sim/log").json()
    assert {e["api"] for e in log} == {"gemini"} and all(e["service_tier"] == "flex" for e in log)
    shed = [e for e in log if e["status"] == 503]  # Google sheds flex traffic with a 503
    assert sum(i.flex_refusals for i in items) == len(shed)
    ledger = _ledger(bulk["id"])
    assert len(ledger) == 4 and {r.tier for r in ledger} == {"flex"}
    for row in ledger:
        flex = _price(row, Tier.FLEX, "gemflex")
        assert row.cost_usd == flex == _price(row, Tier.STANDARD, "gemflex") / 2


def test_a_shared_prefix_is_marked_for_anthropics_cache_and_read_from_it(clean_db, stack):
    make_tenant("shop")
    _sim(stack)

    def line(custom_id: str, system: str) -> dict:
        row = chat_line(custom_id, model="claudy", max_tokens=30)
        row["body"]["messages"].insert(0, {"role": "system", "content": system})
        return row

    rows = [line(f"s{i}", GUIDE) for i in range(6)]
    rows += [line("alone", GUIDE + " Lamps only."), line("short", "Be brief.")]
    batch = python_api.submit_batch(rows, tenant="shop", completion_window="1h")
    keys = {i.custom_id: i.prefix_key for i in _items(batch["id"])}
    shared = {keys[f"s{i}"] for i in range(6)}
    assert len(shared) == 1 and None not in shared
    assert keys["alone"] is None and keys["short"] is None  # nothing to share
    wait_batches([batch["id"]], timeout_s=60)
    with db.session_scope() as s:
        rows_by_id = dict(
            s.execute(
                select(Item.custom_id, UsageLedger)
                .join(UsageLedger, UsageLedger.item_id == Item.id)
                .where(Item.batch_id == batch["id"])
            ).all()
        )
    marked = [rows_by_id[f"s{i}"] for i in range(6)]
    assert sum(r.cache_write_tokens for r in marked) > 0  # the breakpoint was there
    reads = [r for r in marked if r.cached_tokens > 0]
    assert len(reads) >= 5  # written once, then read
    claude = get_registry()["claudy"]
    for r in marked:  # a read at a tenth of the input price, a write at 1.25x
        usage = TokenUsage(
            r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.cache_write_tokens
        )
        assert r.cost_usd == price_usage(usage, claude)
    for custom_id in ("alone", "short"):
        assert rows_by_id[custom_id].cache_write_tokens == rows_by_id[custom_id].cached_tokens == 0


def test_each_item_gets_its_route_and_a_bad_route_changes_nothing(clean_db, stack):
    from batchgen.api import create_app
    from batchgen.errors import ValidationFailed
    from batchgen.store.schema import Batch
    from tests.helpers import jsonl

    key = make_tenant("shop")
    _sim(stack)
    rows = [chat_line("plain", model="flexy"), chat_line("asks", model="flexy")]
    rows[1]["body"]["service_tier"] = "flex"  # the line asks for flex itself
    interactive = python_api.submit_batch(rows, tenant="shop", completion_window="1h")
    assert interactive["route"] == "auto"
    assert {i.custom_id: i.route for i in _items(interactive["id"])} == {
        "plain": "standard",  # interactive work runs standard
        "asks": "flex",
    }
    forced = python_api.submit_batch(
        [chat_line("f", model="flexy")], tenant="shop", completion_window="1h", route="flex"
    )
    standard = python_api.submit_batch(
        rows, tenant="shop", completion_window="1h", priority="bulk", route="standard"
    )
    assert [i.route for i in _items(forced["id"])] == ["flex"]
    assert {i.route for i in _items(standard["id"])} == {"standard"}
    wait_batches([interactive["id"], forced["id"], standard["id"]], timeout_s=60)
    with db.session_scope() as s:
        before = s.scalar(select(func.count()).select_from(Item))
    claude = [chat_line("c", model="claudy")]
    with pytest.raises(ValidationFailed, match="line 1: route 'flex' but model 'claudy'"):
        python_api.submit_batch(claude, tenant="shop", route="flex")
    with pytest.raises(ValidationFailed, match="disagree"):
        python_api.submit_batch(rows, tenant="shop", route="standard", offload="always")
    api = create_app().test_client()
    answer = api.post(
        "/v1/batches?route=cheapest",
        data=jsonl(rows),
        headers={"Authorization": f"Bearer {key}"},
    )
    assert answer.status_code == 400
    assert answer.get_json()["error"]["param"] == "route"
    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Item)) == before
        assert s.scalar(select(func.count()).select_from(Batch)) == 3
