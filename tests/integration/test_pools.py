"""Deployment pools: the gate's pick across deployments (one script, no overshoot),
the circuit breaker, and failover end to end (real workers, the simulator's lanes)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter
from dataclasses import replace
from decimal import Decimal

import pytest
from sqlalchemy import func, select, update

from batchgen import python_api
from batchgen.config import Settings, get_settings
from batchgen.domain.scheduling.pools import breaker_cooldown_s
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import get_redis
from batchgen.limits.budget import Budget, SettleOps
from batchgen.registry import load_registry
from batchgen.simulator import SimulatorConfig, SimulatorThread
from batchgen.simulator.state import key_id
from batchgen.store import db
from batchgen.store.schema import Item, Tenant, UsageLedger
from tests import http_client
from tests.helpers import (
    chat_line,
    make_tenant,
    statements_sent,
    usage_by_deployment_from_ledger,
    wait_batches,
)
from tests.registries import pool_spec
from tests.waiting import wait_until

NOW = 1_000_000.0


def budget_of(**settings: float) -> Budget:
    return Budget(get_redis(), Settings(**{"budget_window_s": 60, "budget_guard_s": 1, **settings}))


@pytest.mark.parametrize("shape", ["window", "bucket"])
def test_concurrent_entries_fill_every_deployment_and_overshoot_none(clean_db, shape):
    """Eight threads enter at once on a frozen clock: every deployment ends exactly full
    (tokens, requests), none a request over, whatever the interleaving."""
    spec = pool_spec(("a", 3000, 100, 50), ("b", 2000, 100, 50), ("c", 1000, 100, 50), shape=shape)
    budget = budget_of(budget_guard_s=0)
    granted: Counter[str] = Counter()
    lock = threading.Lock()

    def enter(thread: int) -> None:
        for n in range(20):
            grant = budget.enter(spec, f"{thread}:{n}", 0, 100, now_s=NOW)
            if grant.granted:
                with lock:
                    granted[grant.deployment] += 1

    threads = [threading.Thread(target=enter, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert granted == {"a": 30, "b": 20, "c": 10}
    for d in spec.deployments:
        tokens, _ = budget.used(spec.at(d), now_s=NOW)
        assert tokens == d.tokens_per_min


def test_concurrent_entries_take_no_more_slots_than_each_deployment_has(clean_db):
    spec = pool_spec(("a", 10**6, 10**4, 3), ("b", 10**6, 10**4, 2), ("c", 10**6, 10**4, 1))
    budget = budget_of()
    grants: list[str] = []
    lock = threading.Lock()

    def enter(thread: int) -> None:
        for n in range(5):
            grant = budget.enter(
                spec, f"{thread}:{n}", 0, 10, slot_limit=spec.max_concurrency, slot_lease_s=30
            )
            if grant.granted:
                with lock:
                    grants.append(grant.deployment)

    threads = [threading.Thread(target=enter, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(grants) == {"a": 3, "b": 2, "c": 1}
    redis = get_redis()
    assert redis.zcard(keys.slots("pool")) == 6  # the model's set: every holder
    assert [redis.zcard(keys.slots(f"pool@{n}")) for n in "abc"] == [3, 2, 1]
    # A slot freed on b goes to the next entry there, and nowhere else.
    holder = next(m.decode() for m in redis.zrange(keys.slots("pool@b"), 0, 0))
    budget.settle(spec.at("b"), holder, SettleOps(release_slot=True))
    grant = budget.enter(spec, "late:1", 0, 10, slot_limit=spec.max_concurrency, slot_lease_s=30)
    assert (grant.granted, grant.deployment) == (True, "b")


def test_calls_spread_by_headroom_so_deployments_fill_at_one_pace(clean_db):
    spec = pool_spec(("a", 6000, 1000, 9), ("b", 4000, 1000, 9), ("c", 2000, 1000, 9))
    budget = budget_of()
    picks = [budget.enter(spec, f"i:{n}", 0, 100, now_s=NOW).deployment for n in range(30)]
    share = Counter(picks)
    # In proportion to their limits (15 : 10 : 5), within one call.
    assert abs(share["a"] - 15) <= 1 and abs(share["b"] - 10) <= 1 and abs(share["c"] - 5) <= 1


def test_the_deployment_to_avoid_goes_last(clean_db):
    spec = pool_spec(("a", 6000, 100, 9), ("b", 1000, 100, 9))
    budget = budget_of()
    # a has by far the most headroom; avoided, b takes the call while it has room.
    assert budget.enter(spec, "x:1", 0, 500, avoid="a", now_s=NOW).deployment == "b"
    assert budget.enter(spec, "x:2", 0, 500, avoid="a", now_s=NOW).deployment == "b"
    # b is full: a takes it rather than the call waiting.
    assert budget.enter(spec, "x:3", 0, 500, avoid="a", now_s=NOW).deployment == "a"
    assert budget.enter(spec, "x:4", 0, 500, now_s=NOW).deployment == "a"


def test_a_failing_deployment_cools_down_is_skipped_then_tried_again(clean_db):
    spec = pool_spec(("a", 10**6, 10**4, 9), ("b", 1000, 10**4, 9))
    budget = budget_of(breaker_failures=3, breaker_cooldown_s=0.4, max_cooldown_s=5)
    a = spec.at("a")
    fail = SettleOps(breaker="fail")
    assert [budget.settle(a, "", fail).tripped_s for _ in range(3)] == [0, 0, 0.4]
    assert budget.settle(a, "", fail).tripped_s == 0  # a failure while it cools down
    tripped = time.monotonic()
    # a has most headroom, but cools down: the calls go to b (while b has room).
    picks = [budget.enter(spec, f"c:{n}", 0, 10).deployment for n in range(5)]
    assert picks == ["b"] * 5
    # After the cooldown it is picked again (waited for as a condition, not a sleep).
    tries = iter(range(10**6))
    wait_until(
        lambda: budget.enter(spec, f"d:{next(tries)}", 0, 10).deployment == "a",
        5,
        "a to come back",
        0.02,
    )
    assert time.monotonic() - tripped >= 0.35
    # The probe after a cooldown: one failure opens it again, for twice as long.
    assert budget.settle(a, "", fail).tripped_s == pytest.approx(breaker_cooldown_s(2, 0.4, 5))
    get_redis().delete(keys.cooldown(a.budget_key))
    # An answer closes it: failures count from zero again.
    budget.settle(a, "", SettleOps(breaker="ok"))
    assert [budget.settle(a, "", fail).tripped_s for _ in range(3)] == [0, 0, 0.4]


def test_a_call_sent_before_the_trip_does_not_trip_it_again(clean_db):
    spec = pool_spec(("a", 10**6, 10**4, 9), ("b", 1000, 10**4, 9))
    budget = budget_of(breaker_failures=3, breaker_cooldown_s=0.4, max_cooldown_s=5)
    a = spec.at("a")
    fail = SettleOps(breaker="fail")
    # A call granted on a (most headroom) before a trips, still out when it cools down.
    assert budget.enter(spec, "early:1", 0, 10).deployment == "a"
    assert [budget.settle(a, "", fail).tripped_s for _ in range(3)] == [0, 0, 0.4]
    get_redis().delete(keys.cooldown(a.budget_key))  # the cooldown is over
    # Its failure, coming in after the cooldown, says nothing of a now: no new trip.
    assert budget.settle(a, "early:1", fail).tripped_s == 0
    # A probe sent after the cooldown does: it opens again, for twice as long.
    assert budget.settle(a, "", fail).tripped_s == pytest.approx(breaker_cooldown_s(2, 0.4, 5))


def test_a_call_sent_over_a_window_before_the_trip_does_not_trip_it_again(clean_db):
    """A call granted so long ago that its reservation left the budget's log (a hung
    call, cut by its time-out long after) was sent before a trip made since."""
    spec = pool_spec(("a", 10**6, 10**4, 9), ("b", 1000, 10**4, 9))
    budget = budget_of(breaker_failures=3, breaker_cooldown_s=0.4, max_cooldown_s=5)
    a = spec.at("a")
    fail = SettleOps(breaker="fail")
    assert budget.enter(spec, "hung:1", 0, 10).deployment == "a"
    assert [budget.settle(a, "", fail).tripped_s for _ in range(3)] == [0, 0, 0.4]
    # A window later its reservation has aged out of the log.
    assert get_redis().zrem(keys.budget_log(a.budget_key), "hung:1") == 1
    get_redis().delete(keys.cooldown(a.budget_key))  # the cooldown is over
    assert budget.settle(a, "hung:1", fail).tripped_s == 0


def test_a_model_of_one_deployment_keeps_its_keys(clean_db):
    spec = load_registry(get_settings().paths.models_file)["sim-small"]
    assert [d.name for d in spec.deployments] == ["default"]
    budget = budget_of()
    grant = budget.enter(spec, "9:1", 0, 10, slot_limit=spec.max_concurrency, slot_lease_s=5)
    assert (grant.granted, grant.deployment) == (True, "default")
    names = {k.decode() for k in get_redis().keys("bg:*")}
    assert names == {
        keys.budget_log("sim-account"),
        keys.budget_amounts("sim-account"),
        keys.budget_meta("sim-account"),
        keys.slots("sim-small"),
        keys.gate_state(),  # set by clean_db: the state known good
    }


POOL_MODEL = """
[models."pool"]
provider = "openai"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "pool"
context_window = 16384
max_output_tokens = 400
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
"""
POOL_TOML = (
    POOL_MODEL
    + """max_attempts = 1
call_timeout_s = 1.0

# Listed first: with room everywhere, the first calls go here.
[models."pool".deployments.bad]
base_url = "{base_url}/d/bad/v1"
tokens_per_min = 10000000
requests_per_min = 100000
max_concurrency = 8

[models."pool".deployments.east]
provider = "azure"
base_url = "{base_url}/d/east"
azure_deployment = "gpt-east"
api_version = "2024-10-21"
api_key_env = "POOL_AZURE_KEY"
region = "eastus"
tokens_per_min = 10000000
requests_per_min = 100000
max_concurrency = 8
output_usd_per_1m = 4.0
"""
)


@pytest.mark.slow
def test_calls_fail_over_to_azure_within_the_deadline_using_no_attempt(
    clean_db, tmp_path, monkeypatch, workers
):
    """One deployment fails every call (5xx or a hang past the call's timeout), the other
    is an Azure deployment: every item succeeds on its first failure attempt
    (max_attempts = 1), within its deadline, and the ledger says which deployment
    served each call, the wasted ones too."""
    lanes = {"bad": {"fault_rate": 1.0, "fault_kinds": ["5xx", "hang"]}, "east": {}}
    config = SimulatorConfig(hang_s=3.0, seed=5, deployments=lanes)
    with SimulatorThread(config) as sim:
        models = tmp_path / "models.toml"
        models.write_text(POOL_TOML.format(base_url=sim.base_url))
        env = {
            "BATCHGEN_MODELS_FILE": str(models),
            "POOL_AZURE_KEY": "azure-secret",
            "BATCHGEN_BREAKER_FAILURES": "3",
            "BATCHGEN_BREAKER_COOLDOWN_S": "60",
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        get_settings.cache_clear()
        make_tenant("acme")
        rows = [chat_line(f"r{i}", model="pool", text=f"item {i}") for i in range(16)]
        batch = python_api.submit_batch(rows, tenant="acme", completion_window=120)
        workers(["llm.pool", "batchgen.control"], concurrency=4, env=env)
        wait_batches([batch["id"]], timeout_s=120)
        log = http_client.get(f"{sim.base_url}/_sim/log").json()
    get_settings.cache_clear()

    counts = python_api.get_batch(batch["id"], tenant="acme")["request_counts"]
    assert counts["succeeded"] == 16, counts
    bad = [e for e in log if e["deployment"] == "bad"]
    hangs = [e for e in bad if e["fault"] == "hang"]
    assert len(bad) >= 3, "the failing deployment must have been tried"
    # The breaker: three failures opened it; only calls already on their way came after,
    # at most as many as bad's 8 slots hold at once (a pack's calls overlap).
    assert len(bad) <= 3 + 8
    east = [e for e in log if e["deployment"] == "east"]
    assert {e["model"] for e in east} == {"gpt-east"}  # the Azure deployment, in the path
    assert {e["key"] for e in east} == {key_id("azure-secret")}  # its key, api-key header
    with db.session_scope() as s:
        items = s.execute(
            select(
                Item.attempts, Item.failovers, Item.deadline_at, Item.finished_at, Item.deployment
            )
        ).all()
        assert all(i.attempts - i.failovers == 1 for i in items)  # no failure attempt used
        assert sum(i.failovers for i in items) == len(bad)
        assert all(i.finished_at < i.deadline_at for i in items)
        assert {i.deployment for i in items} == {"east"}
        ledger = s.execute(
            select(
                UsageLedger.deployment,
                UsageLedger.waste_reason,
                UsageLedger.cost_usd,
                UsageLedger.prompt_tokens,
                UsageLedger.completion_tokens,
            )
        ).all()
        served = [r for r in ledger if r.waste_reason is None]
        assert len(served) == 16 and {r.deployment for r in served} == {"east"}
        # Priced at east's own output price ($4 / 1M), the model's input price ($1 / 1M).
        for r in served:
            assert r.cost_usd == Decimal(r.prompt_tokens + 4 * r.completion_tokens) / 10**6
        # A hang past the timeout may be billed: ledgered as waste, against its deployment.
        wasted = [r for r in ledger if r.waste_reason is not None]
        assert sorted(r.waste_reason for r in wasted) == ["failover_timeout"] * len(hangs)
        assert {r.deployment for r in wasted} <= {"bad"}
        assert s.scalar(select(func.count()).select_from(UsageLedger)) == 16 + len(hangs)
    # The usage report, by deployment.
    rows = {r["deployment"]: r for r in python_api.usage(tenant="acme", group_by="deployment")}
    assert rows["east"]["model"] == "pool" and rows["east"]["requests"] == 16
    assert rows["east"]["wasted_requests"] == 0
    (by_model,) = python_api.usage(tenant="acme")
    assert set(by_model) <= set(rows["east"])  # the same fields as by model, and more
    assert by_model["requests"] == sum(r["requests"] for r in rows.values())
    if hangs:
        assert rows["bad"]["requests"] == rows["bad"]["wasted_requests"] == len(hangs)
    assert python_api.usage(tenant=None, group_by="deployment") == (
        usage_by_deployment_from_ledger()
    )


TWO_LANES_TOML = (
    POOL_MODEL
    + """
# One call at a time each: with calls in flight on one, the next goes to the other.
[models."pool".deployments.east]
base_url = "{base_url}/d/east/v1"
tokens_per_min = 10000000
requests_per_min = 100000
max_concurrency = 1

[models."pool".deployments.west]
base_url = "{base_url}/d/west/v1"
tokens_per_min = 10000000
requests_per_min = 100000
max_concurrency = 1
output_usd_per_1m = 3.0
"""
)


def test_usage_by_deployment_is_the_ledgers_read_from_totals(
    clean_db, tmp_path, monkeypatch, workers
):
    """Real calls on two deployments of a model, for two tenants: the usage by
    deployment, from deployment_daily_usage, is what the ledger's rows sum to (each
    tenant's and every tenant's), and reading it sends no statement to the ledger."""
    config = SimulatorConfig(latency_base_ms=100, seed=7, deployments={"east": {}, "west": {}})
    with SimulatorThread(config) as sim:
        models = tmp_path / "models.toml"
        models.write_text(TWO_LANES_TOML.format(base_url=sim.base_url))
        monkeypatch.setenv("BATCHGEN_MODELS_FILE", str(models))
        get_settings.cache_clear()
        batches = []
        for tenant in ("acme", "zeta"):
            make_tenant(tenant)
            rows = [chat_line(f"r{i}", model="pool", text=f"{tenant} {i}") for i in range(8)]
            batches.append(python_api.submit_batch(rows, tenant=tenant)["id"])
        workers(
            ["llm.pool", "batchgen.control"],
            concurrency=4,
            env={"BATCHGEN_MODELS_FILE": str(models)},
        )
        wait_batches(batches, timeout_s=120)
    get_settings.cache_clear()

    with statements_sent() as sent:
        everyone = python_api.usage(tenant=None, group_by="deployment")
    assert {r["deployment"] for r in everyone} == {"east", "west"}
    assert sum(r["requests"] for r in everyone) == 16
    assert everyone == usage_by_deployment_from_ledger()
    assert not [q for q, _ in sent if "usage_ledger" in q], sent
    with db.session_scope() as s:
        acme = s.scalar(select(Tenant.id).where(Tenant.name == "acme"))
    by_acme = python_api.usage(tenant="acme", group_by="deployment")
    assert by_acme == usage_by_deployment_from_ledger(acme)
    assert sum(r["requests"] for r in by_acme) == 8


def test_a_failover_after_its_batch_was_cancelled_ends_the_item_cancelled(clean_db):
    """A call fails on its deployment while its batch is being cancelled, the cancel
    committing first (it leaves the sent item to its worker): the failover must not hand
    the item on to another deployment, which would start a provider request after the
    cancel. The item ends cancelled, the billed call in the ledger once."""
    from batchgen.errors import TransientProviderError
    from batchgen.registry import get_registry
    from batchgen.store import items
    from batchgen.worker.cancellation import cancel_batch
    from batchgen.worker.dispatch import release_all
    from batchgen.worker.failures import failover

    registry, settings = get_registry(), get_settings()
    make_tenant("acme")
    batch = python_api.submit_batch([chat_line("only")], tenant="acme")
    with db.session_scope() as s:
        (released,) = release_all(s, registry, settings)
    ticket = released.ticket
    with db.autocommit() as connection:
        item = items.claim_sent(connection, ticket, 60.0, time.monotonic(), "a", claim_token=1)
    assert item is not None
    cancel_batch(batch["id"], "acme")  # the call is under way: the item stays running

    error = TransientProviderError("server error 503", status=503, billed=True)
    verdict = failover(item, registry["sim-small"], settings, error, 10, ticket)

    assert verdict.ticket is None and verdict.outcome == "cancelled"
    with db.session_scope() as s:
        assert s.scalar(select(Item.status).where(Item.id == item.item_id)) == "cancelled"
        ledger = s.execute(select(UsageLedger.attempt, UsageLedger.waste_reason)).all()
    assert [tuple(r) for r in ledger] == [(1, "failover_server_error")]
    assert python_api.get_batch(batch["id"], tenant="acme")["status"] == "cancelled"


def test_an_item_handed_back_after_its_batch_was_cancelled_is_never_claimed(clean_db):
    """A 429 (or a budget wait) hands a running item back to the queue; if its batch was
    cancelled meanwhile (the cancel left the sent item to its worker), no claim may take
    it again: a provider request would start after the cancel. The sweep ends it."""
    from batchgen.errors import RateLimited
    from batchgen.registry import get_registry
    from batchgen.store import items
    from batchgen.worker.cancellation import cancel_batch
    from batchgen.worker.dispatch import release_all
    from batchgen.worker.failures import rate_limited_call
    from batchgen.worker.sweep import sweep

    registry, settings = get_registry(), get_settings()
    make_tenant("acme")
    batch = python_api.submit_batch([chat_line("only")], tenant="acme")
    with db.session_scope() as s:
        (released,) = release_all(s, registry, settings)
    with db.autocommit() as connection:
        item = items.claim_sent(
            connection, released.ticket, 60.0, time.monotonic(), "a", claim_token=1
        )
    assert item is not None
    cancel_batch(batch["id"], "acme")  # the call is under way: the item stays running

    limited = RateLimited("429", retry_after_s=0.1)
    assert rate_limited_call(item, settings, limited).outcome == "wait"
    with db.session_scope() as s:
        assert s.scalar(select(Item.status).where(Item.id == item.item_id)) == "queued"
    again = replace(released.ticket, attempt=item.attempt)  # the attempt was handed back
    with db.autocommit() as connection:
        mono_s = time.monotonic()
        assert items.claim_sent(connection, again, 60.0, mono_s, "a", claim_token=2) is None
        assert items.claim(connection, item.item_id, 60.0, time.monotonic()) is None

    with db.session_scope() as s:
        sweep(s, settings)
    assert python_api.get_batch(batch["id"], tenant="acme")["status"] == "cancelled"


SLOW_POOL_TOML = """
[models."pool"]
provider = "openai"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "pool"
context_window = 16384
max_output_tokens = 400
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
call_timeout_s = 30.0

[models."pool".deployments.slow]
base_url = "{base_url}/d/slow/v1"
tokens_per_min = 10000000
requests_per_min = 100000
max_concurrency = 8

[models."pool".deployments.other]
base_url = "{base_url}/d/other/v1"
tokens_per_min = 10000000
requests_per_min = 100000
max_concurrency = 8
"""


DEADLINE_S = 8.0


def test_a_call_cut_short_by_its_own_deadline_does_not_trip_the_breaker(
    clean_db, tmp_path, monkeypatch
):
    """A call whose time-out is its item's time left (a caller's short ``timeout``, an
    item near its deadline) times out on a healthy deployment that is only slower than
    that: the failure is the item's, not the deployment's. Counted by the breaker, any
    tenant could close every deployment of a model to everyone with a few calls of a
    short timeout."""
    from batchgen.limits.gate import Gate
    from batchgen.registry import get_registry
    from batchgen.worker.dispatch import release_all
    from batchgen.worker.execution import run_item

    lanes = {"slow": {"fault_rate": 1.0, "fault_kinds": ["hang"]}, "other": {}}
    # The deadline (DEADLINE_S) leaves a loaded machine ample time to start the call,
    # and the hang outlasts it: the call is cut by the deadline, not by the hang.
    with SimulatorThread(SimulatorConfig(hang_s=30.0, seed=1, deployments=lanes)) as sim:
        models = tmp_path / "models.toml"
        models.write_text(SLOW_POOL_TOML.format(base_url=sim.base_url))
        monkeypatch.setenv("BATCHGEN_MODELS_FILE", str(models))
        monkeypatch.setenv("BATCHGEN_BREAKER_FAILURES", "1")  # one failure trips it
        get_settings.cache_clear()
        try:
            registry, settings = get_registry(), get_settings()
            spec = registry["pool"]
            make_tenant("acme")
            python_api.submit_batch([chat_line("r", model="pool")], tenant="acme")
            with db.session_scope() as s:  # the item has DEADLINE_S left
                left = dt.timedelta(seconds=DEADLINE_S)
                s.execute(update(Item).values(deadline_at=func.now() + left))
                (released,) = release_all(s, registry, settings)
            verdict = run_item(
                released.ticket.item_id,
                registry,
                settings,
                Gate(get_redis(), settings),
                model="pool",
                ticket=released.ticket,
            )
            assert verdict.outcome == "expired"
        finally:
            get_settings.cache_clear()
    with db.session_scope() as s:  # the call went to slow, and was cut at the deadline
        item = s.execute(select(Item.deployment, Item.last_error)).one()
    assert item.deployment == "slow" and "timeout" in (item.last_error or "")
    assert get_redis().pttl(keys.cooldown(spec.at("slow").budget_key)) < 0  # no breaker
