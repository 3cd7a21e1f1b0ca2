"""Usage by key, against a live API process, a worker and the provider simulator: each
ledger row counts for the key its batch or call was made with
(``GET /v1/usage?group_by=key``), and a submit without a key (the Python API) under
none; the totals by key equal the tenant's totals."""

from __future__ import annotations

import httpx
import pytest

from batchgen import python_api, tenant_admin
from tests.helpers import chat_line, jsonl, make_tenant, wait_batches

pytestmark = pytest.mark.integration

CHAT = {
    "model": "sim-small",
    "messages": [{"role": "user", "content": "Describe a red chair."}],
    "max_tokens": 20,
}


@pytest.fixture(scope="module")
def stack(simulator, module_api_server, module_workers) -> str:
    worker = module_workers(concurrency=2, wait=False)
    base_url = module_api_server()
    worker.wait_ready()
    return base_url


def test_usage_groups_by_the_key_of_each_batch_and_call(clean_db, stack: str):
    owner = make_tenant("acme")
    make_tenant("globex")
    nightly = tenant_admin.create_key("acme", name="nightly", scopes=["batches"])
    shop = tenant_admin.create_key("acme", name="shop", scopes=["calls"])
    with httpx.Client(base_url=stack, timeout=120) as api:
        batch = api.post(
            "/v1/batches",
            content=jsonl([chat_line(f"n-{i}", max_tokens=20) for i in range(3)]),
            headers={"Authorization": f"Bearer {nightly['secret']}"},
        )
        assert batch.status_code == 200, batch.text
        for _ in range(2):
            call = api.post(
                "/v1/chat/completions",
                json=CHAT,
                headers={"Authorization": f"Bearer {shop['secret']}"},
            )
            assert call.status_code == 200, call.text
        keyless = python_api.submit_batch([chat_line("py-1", max_tokens=20)], tenant="acme")
        python_api.submit_batch([chat_line("g-1", max_tokens=20)], tenant="globex")
        wait_batches([batch.json()["id"], keyless["id"]], timeout_s=120)

        by_key = api.get(
            "/v1/usage?group_by=key", headers={"Authorization": f"Bearer {owner}"}
        ).json()["data"]
        by_model = api.get("/v1/usage", headers={"Authorization": f"Bearer {owner}"}).json()["data"]
    rows = {r["key_name"]: r for r in by_key}
    assert set(rows) == {"nightly", "shop", None}  # globex's usage is not acme's
    assert (rows["nightly"]["key"], rows["nightly"]["requests"]) == (nightly["id"], 3)
    assert (rows["shop"]["key"], rows["shop"]["requests"]) == (shop["id"], 2)
    assert rows[None]["requests"] == 1 and rows[None]["key"] is None
    assert rows["nightly"]["key_prefix"] == nightly["prefix"]
    for field in ("requests", "prompt_tokens", "completion_tokens"):
        assert sum(r[field] for r in by_key) == sum(r[field] for r in by_model), field
    assert sum(float(r["cost_usd"]) for r in by_key) == pytest.approx(
        sum(float(r["cost_usd"]) for r in by_model)
    )
