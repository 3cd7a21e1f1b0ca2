"""The autoscaling signal against real PostgreSQL and Redis: a budget-bound model asks
for no more worker slots than its budget keeps busy, an idle group for none, and the
gauges reach /metrics per group."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchgen.api import create_app
from batchgen.config import get_settings
from batchgen.domain.scheduling.autoscale import Demand
from batchgen.limits.backend import get_redis
from batchgen.limits.concurrency import Slots
from batchgen.monitoring import runnable
from batchgen.registry import Registry, get_registry
from batchgen.store import db
from batchgen.store import ready_items as ready_store
from tests.helpers import chat_line, jsonl, make_tenant

pytestmark = pytest.mark.integration

TOKEN = "scrape-token-for-tests"
CALL_S = 10.0  # the observed call time, as the latency totals would say


def test_budget_bound_and_idle_groups(clean_db, monkeypatch):
    monkeypatch.setattr(get_settings().api, "metrics_token", TOKEN)
    monkeypatch.setattr(runnable, "call_times_s", lambda session: {"sim-small": CALL_S})
    api = create_app().test_client()
    key = make_tenant("acme")
    rows = [chat_line(f"r{i}", max_tokens=1000) for i in range(40)]
    res = api.post("/v1/batches", data=jsonl(rows), headers={"Authorization": f"Bearer {key}"})
    assert res.status_code == 200, res.json
    client = get_redis()
    for holder in ("a", "b"):  # two calls running
        assert Slots(client).acquire("sim-small", holder, 16, 60.0)

    # 6 000 tokens/min at ~1 000 tokens a call: 6 calls a minute, 10 s each: one slot.
    real = get_registry()
    bound = Registry(
        {
            name: spec.model_copy(update={"tokens_per_min": 6000}) if name == "sim-small" else spec
            for name, spec in real.models.items()
        }
    )
    with db.session_scope() as session:
        found = runnable.demands(session, client, bound, get_settings())
        ready = ready_store.ready(session, {"sim-small": 100})["sim-small"]
        capped = ready_store.ready(session, {"sim-small": 5, "sim-large": 5})
    assert ready.items == 40 and 1000 < ready.tokens_per_item < 1100
    assert capped["sim-small"].items == 5 and "sim-large" not in capped  # counted up to a cap
    assert found["sim"] == Demand(runnable_items=int(6000 // ready.tokens_per_item), worker_slots=1)
    assert found["sim-large"] == Demand(0, 0)

    # The shipped registry (2M tokens/min): not budget-bound, up to max_concurrency.
    scrape = api.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    gauges = {
        (s.name, s.labels["queue"]): s.value
        for family in text_string_to_metric_families(scrape.text)
        for s in family.samples
        if s.name in (runnable.SLOTS_WANTED, runnable.RUNNABLE_ITEMS)
    }
    assert gauges[(runnable.SLOTS_WANTED, "llm.sim")] == 16
    assert gauges[(runnable.RUNNABLE_ITEMS, "llm.sim")] == 14  # the free slots
    assert gauges[(runnable.SLOTS_WANTED, "llm.sim-large")] == 0
    assert gauges[(runnable.RUNNABLE_ITEMS, "llm.sim-large")] == 0
