"""A provider 429 is a budget signal, not a failure: it uses no failure attempt,
and a cap of its own ends an item whose provider keeps refusing it."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from batchgen import python_api
from batchgen.config import get_settings
from batchgen.simulator import SimulatorConfig, SimulatorThread
from batchgen.store import db
from batchgen.store.schema import Item, UsageLedger
from tests import http_client
from tests.helpers import chat_line, make_tenant, wait_batches

MODELS_TOML = """
[models."strict"]
provider = "openai"
base_url = "{base_url}/v1"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "strict"
budget_key = "strict-account"
context_window = 16384
max_output_tokens = 400
tokens_per_min = 10000000
requests_per_min = 100000
max_concurrency = 8
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
encoding = "cl100k_base"
charge_policy = "reserve"
max_attempts = 1
"""


@pytest.fixture
def refusing(clean_db, tmp_path, monkeypatch, request):
    """A simulator answering a share of calls with a spurious 429 (retry-after 1 s), and a
    model that fails on its first real failure (max_attempts = 1)."""
    fault_rate, max_rate_limited = request.param
    config = SimulatorConfig(fault_rate=fault_rate, fault_kinds=("429",), seed=11)
    with SimulatorThread(config) as sim:
        models = tmp_path / "models.toml"
        models.write_text(MODELS_TOML.format(base_url=sim.base_url))
        env = {
            "BATCHGEN_MODELS_FILE": str(models),
            "BATCHGEN_MAX_RATE_LIMITED": str(max_rate_limited),
            "BATCHGEN_MAX_COOLDOWN_S": "0.2",
            "BATCHGEN_SWEEP_INTERVAL_S": "1",
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        get_settings.cache_clear()
        yield sim, env
    get_settings.cache_clear()


def _calls_per_item(sim) -> dict[str, list[int]]:
    calls: dict[str, list[int]] = {}
    for entry in http_client.get(f"{sim.base_url}/_sim/log").json():
        calls.setdefault(entry.get("item") or "", []).append(entry["status"])
    return calls


@pytest.mark.parametrize("refusing", [(0.5, 25)], indirect=True)
def test_429s_use_no_failure_attempt(refusing, workers):
    sim, env = refusing
    make_tenant("acme")
    rows = [chat_line(f"r{i}", model="strict", text=f"item {i}") for i in range(24)]
    batch = python_api.submit_batch(rows, tenant="acme")
    workers(["llm.strict", "batchgen.control"], concurrency=8, env=env)
    wait_batches([batch["id"]], timeout_s=120)

    counts = python_api.get_batch(batch["id"], tenant="acme")["request_counts"]
    assert counts["succeeded"] == 24, counts
    calls = _calls_per_item(sim)
    refused = sum(statuses.count(429) for statuses in calls.values())
    assert refused >= 5, "the fault must hit: several items saw a 429 first"
    with db.session_scope() as s:
        # max_attempts = 1, yet every item with a 429 went on to succeed: no attempt used.
        assert s.scalar(select(func.max(Item.attempts))) == 1
        assert s.scalar(select(func.sum(Item.rate_limited))) == refused
        # A 429 is not billed: one ledger row per item, its result.
        assert s.scalar(select(func.count()).select_from(UsageLedger)) == 24


@pytest.mark.parametrize("refusing", [(1.0, 4)], indirect=True)
def test_an_item_refused_every_time_ends_at_its_429_cap(refusing, workers):
    sim, env = refusing
    make_tenant("acme")
    rows = [chat_line(f"r{i}", model="strict", text=f"item {i}") for i in range(3)]
    batch = python_api.submit_batch(rows, tenant="acme")
    workers(["llm.strict", "batchgen.control"], concurrency=4, env=env)
    wait_batches([batch["id"]], timeout_s=120)

    counts = python_api.get_batch(batch["id"], tenant="acme")["request_counts"]
    assert counts["failed"] == 3, counts
    with db.session_scope() as s:
        codes = set(s.scalars(select(Item.error_code)))
        assert codes == {"rate_limited"}
        assert set(s.scalars(select(Item.rate_limited))) == {4}
    assert sorted(len(statuses) for statuses in _calls_per_item(sim).values()) == [4, 4, 4]
