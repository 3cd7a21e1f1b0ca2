"""Every Lua script's keys hash to one Redis Cluster slot (``redis.crc.key_slot``),
as each caller builds them: the gate's scripts for a model of several deployments
and a tenant budget, the slots, call shares, key rate, dollar budgets and the beat
lock. A client that records each script call stands in for Redis."""

from __future__ import annotations

from importlib import resources
from typing import Any

import pytest
from redis.crc import key_slot

from batchgen.config import Settings, get_settings
from batchgen.domain.scheduling.gate_rebuild import HeldSlot, RebuildPlan, SpentBudget
from batchgen.errors import ConfigError
from batchgen.limits import backend
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import parse_nodes_url
from batchgen.limits.budget import Budget, SettleOps
from batchgen.limits.call_demand import CallDemand
from batchgen.limits.concurrency import Slots
from batchgen.limits.gate_state import rebuild
from batchgen.limits.key_rate import take
from batchgen.limits.money_budgets import Ask, MoneyBudgets, Settle
from batchgen.registry import parse_registry
from batchgen.worker.beat import ScheduleLock
from tests.unit.test_pools import MODEL, POOL


class Recorded(Exception):
    """Raised by the recording client once a script call is recorded."""


class RecordingRedis:
    """Records ``(script name, keys)`` of every script call, then raises
    :class:`Recorded` (no reply to parse)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self._names = {backend._source(n): n for n in script_names()}
        self._names.update({backend.each_source(n): n for n in script_names()})

    def register_script(self, source: str) -> Any:
        client, name = self, self._names[source]

        class Runner:
            sha = name
            script = source

            def __call__(self, keys: list[str], args: list[Any] | None = None) -> Any:
                client.calls.append((name, [str(k) for k in keys]))
                raise Recorded

        return Runner()

    def pipeline(self, transaction: bool = False) -> Any:
        client = self

        class Pipe:
            def evalsha(self, sha: str, numkeys: int, *rest: Any) -> None:
                client.calls.append((sha, [str(k) for k in rest[:numkeys]]))

            def execute(self, raise_on_error: bool = True) -> list[Any]:
                raise Recorded

        return Pipe()


def script_names() -> list[str]:
    lua = resources.files("batchgen.limits").joinpath("lua")
    return sorted(p.name[:-4] for p in lua.iterdir() if p.name.endswith(".lua"))


def record(client: RecordingRedis, call: Any) -> None:
    with pytest.raises(Recorded):
        call()


def test_every_scripts_keys_hash_to_one_slot() -> None:
    spec = parse_registry(MODEL + POOL)["m"]  # deployments a and b, budgets of their own
    client = RecordingRedis()
    r: Any = client
    budget = Budget(r, get_settings())
    for d in spec.deployments:
        view = spec.at(d)
        settle = SettleOps(action="reconcile", tenant_id=7, release_slot=True, breaker="fail")
        record(client, lambda v=view, s=settle: budget.settle(v, "res:1", s))
        record(client, lambda v=view, s=settle: budget.settle_many([(v, "res:1", s)]))
        record(client, lambda v=view: budget.cool_down(v, 5.0))
    enter = {"tenant_id": 7, "tenant_tokens_per_min": 100, "slot_limit": 3, "urgent": True}
    record(client, lambda: budget.enter(spec, "res:1", 10, 5, **enter))
    entry = {"reservation_id": "r", "prompt_tokens": 1, "rest_tokens": 1, **enter}
    record(client, lambda: budget.enter_many(spec, [entry]))
    record(client, lambda: budget.used(spec))
    record(client, lambda: Slots(r).acquire("m", "holder", 2, 5.0))
    record(client, lambda: Slots(r).held("m"))
    record(client, lambda: CallDemand(r).read("m", "7:1:9"))
    record(client, lambda: take(r, 3, 60))
    money = MoneyBudgets(r)
    tenant_budget, key_budget = keys.money(7, 1, "2026-12"), keys.money(7, 2, "2026-12")
    asks = [Ask(tenant_budget, 5, 10), Ask(key_budget, 5, 10)]
    record(client, lambda: money.reserve(7, "r", asks, 60))
    record(client, lambda: money.settle(tenant_budget, "r", 5))
    record(client, lambda: money.adopt(7, "r", "9:1"))
    record(client, lambda: money.release([Settle(7, "9:1", 5)]))
    record(client, lambda: ScheduleLock(r, 10.0).hold())
    record(client, lambda: ScheduleLock(r, 10.0).release())
    plan = RebuildPlan(
        tuple(SpentBudget(d.budget_key, 10, 1) for d in spec.deployments),
        tuple(HeldSlot(d.slot_key, "1:1", 5.0) for d in spec.deployments),
    )
    record(client, lambda: rebuild(r, plan, "token", 60.0, 1.0))

    assert {name for name, _ in client.calls} == set(script_names())
    for name, script_keys in client.calls:
        slots = {key_slot(k.encode()) for k in script_keys}
        assert len(slots) == 1, f"{name}: keys in slots {slots}: {script_keys}"


def test_gate_keys_share_one_tag_and_other_keys_spread() -> None:
    gate = [keys.budget_log("acct"), keys.tenant_log(3), keys.slots("m"), keys.counters("m")]
    assert {key_slot(k.encode()) for k in gate} == {key_slot(keys.GATE.encode())}
    spread = {key_slot(keys.running_item(i).encode()) for i in range(50)}
    assert len(spread) > 40


def test_sentinel_and_cluster_urls() -> None:
    sentinel = parse_nodes_url("redis+sentinel://:s%40cret@h1:26380,h2/mymaster/2?ssl=true")
    assert sentinel.hosts == (("h1", 26380), ("h2", 26379))
    assert (sentinel.master, sentinel.db, sentinel.password, sentinel.ssl) == (
        "mymaster",
        2,
        "s@cret",
        True,
    )
    cluster = parse_nodes_url("redis+cluster://a:7000,b:7001")
    assert (cluster.hosts, cluster.db, cluster.master) == ((("a", 7000), ("b", 7001)), 0, "")
    for bad in (
        "redis+sentinel://h1:26379",  # no master name
        "redis+cluster://a:7000/3",  # a cluster has database 0 only
        "redis+cluster:///",  # no host
        "redis://h:6379/0",
    ):
        with pytest.raises(ConfigError):
            parse_nodes_url(bad)


def test_a_sentinel_or_cluster_redis_url_needs_a_broker_of_its_own() -> None:
    settings = Settings(redis_url="redis+sentinel://h1/mymaster", celery_broker_url=None)
    with pytest.raises(RuntimeError, match="CELERY_BROKER_URL"):
        _ = settings.broker_url
    both = Settings(redis_url="redis+cluster://a:7000", celery_broker_url="redis://b:6379/0")
    assert both.broker_url == "redis://b:6379/0"
