"""Redis loses the gate's state mid-run (FLUSHALL of the Redis holding budgets and
slots; the broker is the session's and keeps its messages): the state is rebuilt
conservatively from PostgreSQL (app/worker/gate_recovery.py): the budget restarts as
spent for one window and the running items take their slots again, so no window at
the provider goes over its limit."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import select

from batchgen import python_api as client
from batchgen.config import Settings, get_settings
from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.limits import redis_keys as keys
from batchgen.limits.gate import Gate, Pass, Wait, WaitKind
from batchgen.registry import load_registry
from batchgen.simulator import SimulatorConfig, SimulatorThread
from batchgen.store import db
from batchgen.store.schema import Item
from tests import http_client
from tests.helpers import chat_line, make_tenant, sim_in_flight, wait_batches
from tests.integration.test_faults_redis import OwnRedis
from tests.invariants import check_invariants, wait_until
from tests.registries import model_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WINDOW_S = 4.0
TOKENS_PER_WINDOW = 1500
ITEMS = 24
MODELS_TOML = """
[models."rebuilt"]
provider = "openai"
base_url = "{base_url}/v1"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "rebuilt"
budget_key = "rebuilt-account"
limit_shape = "window"
context_window = 16384
max_output_tokens = 400
tokens_per_min = {tpm}
requests_per_min = 1000
max_concurrency = 8
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
encoding = "cl100k_base"
charge_policy = "reserve"
"""


@pytest.fixture
def limited(clean_db: Any, tmp_path: Any, monkeypatch: Any) -> Iterator[tuple[Any, dict[str, str]]]:
    """A simulator enforcing TOKENS_PER_WINDOW per 4 s window, a registry saying the
    same, and a Redis of the test's own for budgets and slots."""
    config = SimulatorConfig(
        tokens_per_min=TOKENS_PER_WINDOW, window_s=WINDOW_S, latency_base_ms=3000, seed=5
    )
    own = OwnRedis(tmp_path / "gate-redis")
    own.start()
    with SimulatorThread(config) as sim:
        models = tmp_path / "models.toml"
        models.write_text(MODELS_TOML.format(base_url=sim.base_url, tpm=TOKENS_PER_WINDOW))
        env = {
            "BATCHGEN_MODELS_FILE": str(models),
            "BATCHGEN_BUDGET_WINDOW_S": str(WINDOW_S),
            "BATCHGEN_BUDGET_GUARD_S": "1.0",
            "BATCHGEN_SWEEP_INTERVAL_S": "0.5",
            "BATCHGEN_GATE_STATE_CHECK_S": "0.2",
            "REDIS_URL": own.url,
            "CELERY_BROKER_URL": os.environ["REDIS_URL"],  # the session's: not flushed
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        get_settings.cache_clear()
        load_registry.cache_clear()
        try:
            yield sim, env, own
        finally:
            get_settings.cache_clear()
            load_registry.cache_clear()
            own.server.stop()


def _running_holders() -> set[str]:
    with db.session_scope() as s:
        rows = s.execute(
            select(Item.id, Item.attempts).where(Item.status == ItemStatus.RUNNING.value)
        )
        return {f"{i}:{a}" for i, a in rows}


def test_flushed_gate_state_is_rebuilt_as_spent(limited, workers):
    sim, env, own = limited
    r = own.client()
    make_tenant("rebuild")
    lines = [chat_line(f"g{i}", model="rebuilt", max_tokens=100) for i in range(ITEMS)]
    batch = client.submit_batch(lines, tenant="rebuild")
    workers(["llm.rebuilt", "batchgen.control"], concurrency=8, env=env, name="w")
    wait_until(lambda: r.exists(keys.gate_state()), 60, "the gate's first start")
    first = r.get(keys.gate_state())
    # A first start (nothing ran, nothing billed) rebuilds nothing: no budget spent.
    assert not [k for k in r.hkeys(keys.budget_amounts("rebuilt-account")) if b"rebuilt:" in k]
    # The first calls (3 s each) have just started: they are in flight at the rebuild.
    wait_until(lambda: sim_in_flight(sim.base_url) >= 2, 60, "calls in flight", 0.02)
    before = _running_holders()
    assert r.flushall()
    wait_until(lambda: r.get(keys.gate_state()) not in (None, first), 30, "the rebuild")
    amounts = r.hgetall(keys.budget_amounts("rebuilt-account"))
    # (c) the slots held are the running items' (checked again until an item that gave
    # its slot back has recorded its end: new items wait for the spent budget).
    seen: dict[str, set[str]] = {}

    def slots_match() -> bool:
        seen["holders"] = {m.decode() for m in r.zrange(keys.slots("rebuilt"), 0, -1)}
        seen["running"] = _running_holders()
        # The calls in flight at the flush may have ended by the rebuild (a process's
        # entrants wait for it): then no item runs and no slot is held.
        return seen["running"] <= seen["holders"]

    wait_until(slots_match, 3, lambda: f"slots of the running items: {seen}", 0.05)
    assert seen["holders"] <= before | seen["running"], seen
    wait_batches([batch["id"]], timeout_s=120)

    # (b) the budget restarted as spent: one entry of the whole window's tokens.
    rebuilt = {k.decode(): int(v) for k, v in amounts.items() if k.startswith(b"rebuilt:")}
    assert list(rebuilt.values()) == [TOKENS_PER_WINDOW], amounts
    # (a) no window at the provider over its limit, and every invariant.
    stats = http_client.get(f"{sim.base_url}/_sim/stats", timeout=10).json()
    assert stats["max_tokens_in_any_window"] <= TOKENS_PER_WINDOW, stats
    assert stats["rate_limited"] == 0, stats
    report = check_invariants(sim.base_url, r)
    assert report.statuses == {"succeeded": ITEMS}


@dataclass(frozen=True)
class _Ticket:
    item_id: int
    attempt: int = 1
    tenant_id: int = 1
    tenant_tokens_per_min: int | None = None
    prompt_tokens_est: int = 10
    max_tokens: int = 10


def test_an_entry_between_two_state_checks_waits_for_the_rebuild(tmp_path):
    """Redis loses the gate's state just after a process checked its marker: the next
    entries (alone, or a pack's in one pipeline) are refused by the entry script itself,
    the marker being missing, and rebuild the state first instead of passing against
    empty budgets and slots. A rebuild that cannot finish admits nothing."""
    own = OwnRedis(tmp_path / "own-redis")
    own.start()
    try:
        r = own.client()
        settings = Settings(gate_state_check_s=3600.0, slot_wait_s=0.3)  # no timed check
        model = model_spec(key="lost", slots=4)
        found: list[tuple[int, int]] = []  # what each rebuild found taken: slots, log

        def rebuild() -> None:
            found.append((r.zcard(keys.slots(model.name)), r.zcard(keys.budget_log("lost"))))
            r.set(keys.gate_state(), "rebuilt")

        gate = Gate(r, settings, rebuild)
        assert isinstance(gate.enter(model, _Ticket(1)), Pass)  # the first entry's check
        assert r.flushall()
        assert isinstance(gate.enter(model, _Ticket(2)), Pass)
        assert r.flushall()
        assert all(isinstance(d, Pass) for d in gate.enter_many(model, [_Ticket(3), _Ticket(4)]))
        assert found == [(0, 0)] * 3  # each refused entry had taken nothing
        assert r.zcard(keys.slots(model.name)) == 2  # the pack's two, after the rebuild

        assert r.flushall()
        stuck = Gate(r, settings, lambda: None)  # its rebuild fails (the database is away)
        alone = stuck.enter(model, _Ticket(5))
        packed = stuck.enter_many(model, [_Ticket(6), _Ticket(7)])
        for decision in [alone, *packed]:
            assert isinstance(decision, Wait) and decision.kind is WaitKind.SLOT
        assert r.zcard(keys.slots(model.name)) == 0 and r.zcard(keys.budget_log("lost")) == 0
    finally:
        own.server.stop()
