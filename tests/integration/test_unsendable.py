"""A deployment whose requests cannot leave (a base URL or key no client can use) ends
its items failed with the reason, within their attempts, instead of leaving them
queued for ever (real worker and dispatcher, the simulator over HTTP)."""

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

# Every deployment reads its key from BAD_KEY_ENV: a key with a newline (a secret
# file's last line) that no HTTP header can carry. The registry loads it: the key is
# read at call time, in the worker.
BAD_KEY_ENV = "BATCHGEN_TEST_UNSENDABLE_KEY"
LONE_TOML = """
[models."lone-{provider}"]
provider = "{provider}"
base_url = "{{base_url}}{path}"
api_key_env = "{{key_env}}"
group = "lone"
budget_key = "lone-{provider}"
context_window = 16384
max_output_tokens = 400
tokens_per_min = 10000000
requests_per_min = 100000
max_concurrency = 8
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
"""
MODELS_TOML = (
    LONE_TOML.format(provider="openai", path="/v1")
    + LONE_TOML.format(provider="anthropic", path="")
    + """
[models."pair"]
provider = "openai"
base_url = "{base_url}/v1"
api_key_env = "{key_env}"
group = "lone"
context_window = 16384
max_output_tokens = 400
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0

[models."pair".deployments.a]
tokens_per_min = 10000000
requests_per_min = 100000
max_concurrency = 8

[models."pair".deployments.b]
tokens_per_min = 10000000
requests_per_min = 100000
max_concurrency = 8
"""
)


@pytest.mark.slow
def test_items_whose_requests_cannot_leave_end_failed_with_the_reason(
    clean_db, tmp_path, monkeypatch, workers
):
    with SimulatorThread(SimulatorConfig(seed=3)) as sim:
        models = tmp_path / "models.toml"
        models.write_text(MODELS_TOML.format(base_url=sim.base_url, key_env=BAD_KEY_ENV))
        env = {
            "BATCHGEN_MODELS_FILE": str(models),
            BAD_KEY_ENV: "sk-unsendable-key\n",
            "BATCHGEN_MAX_FAILOVERS": "3",
            # Both deployments keep failing: their breakers trip again and again, each
            # cooldown twice the last; kept short, it only slows the pool's items down.
            "BATCHGEN_BREAKER_COOLDOWN_S": "0.5",
            "BATCHGEN_MAX_COOLDOWN_S": "1",
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        get_settings.cache_clear()
        make_tenant("acme")
        batches = [
            python_api.submit_batch(
                [chat_line(f"{model}-{i}", model=model, text=f"item {i}") for i in range(6)],
                tenant="acme",
                completion_window=600,
            )["id"]
            for model in ("lone-openai", "lone-anthropic", "pair")
        ]
        workers(["llm.lone", "batchgen.control"], concurrency=4, env=env)
        # Bounded: on failure the items would stay pending or queued, never ending.
        wait_batches(batches, timeout_s=120)
        log = http_client.get(f"{sim.base_url}/_sim/log").json()
    get_settings.cache_clear()

    assert log == []  # not one request reached the provider
    with db.session_scope() as s:
        rows = s.execute(
            select(
                Item.model,
                Item.status,
                Item.error_code,
                Item.last_error,
                Item.attempts,
                Item.failovers,
            )
        ).all()
        assert len(rows) == 18
        assert {(r.status, r.error_code) for r in rows} == {("failed", "unsendable")}
        for r in rows:
            assert "request not sendable" in r.last_error, r.last_error
            assert "sk-unsendable" not in r.last_error and "item " not in r.last_error
            # A lone deployment: one attempt, failed at once (no retry can mend it).
            # A pool: handed to the other deployment, up to max_failovers, then failed.
            assert r.attempts - r.failovers == 1, r
            assert r.failovers == (3 if r.model == "pair" else 0), r
        # Nothing was sent, so nothing is billed or ledgered as waste.
        assert s.scalar(select(func.count()).select_from(UsageLedger)) == 0
