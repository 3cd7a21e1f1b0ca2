"""End to end: HTTP API → PostgreSQL → dispatcher → Celery worker process → simulator."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select

from batchgen.api import create_app
from batchgen.simulator import request_digest
from batchgen.store import db
from batchgen.store.schema import Item, Result, TenantDailyUsage, UsageLedger
from tests.helpers import TOKEN_KINDS, chat_line, jsonl, make_tenant, usage_totals, wait_batches

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_three_tenants_two_models_200_items(clean_db, simulator, workers):
    api = create_app().test_client()
    keys = {name: make_tenant(name) for name in ("acme", "globex", "initech")}
    sizes = {"acme": 100, "globex": 60, "initech": 40}
    prompts: dict[tuple[str, str], list[dict]] = {}
    batch_ids = {}
    for name, n in sizes.items():
        rows = [
            chat_line(
                f"{name}-{i}",
                model="sim-small" if i % 2 else "sim-large",
                text=f"Tenant {name} product {i}: a {i % 7}-colour widget.",
            )
            for i in range(n)
        ]
        for r in rows:
            prompts[(name, r["custom_id"])] = r["body"]["messages"]
        res = api.post(
            "/v1/batches", data=jsonl(rows), headers={"Authorization": f"Bearer {keys[name]}"}
        )
        assert res.status_code == 200, res.json
        assert res.json["request_counts"]["total"] == n
        assert res.json["request_counts"]["pending"] == n
        batch_ids[name] = res.json["id"]

    worker = workers(concurrency=16)
    wait_batches(list(batch_ids.values()))

    for name, batch_id in batch_ids.items():
        auth = {"Authorization": f"Bearer {keys[name]}"}
        info = api.get(f"/v1/batches/{batch_id}", headers=auth).json
        assert info["status"] == "completed"
        counts = info["request_counts"]
        assert counts["total"] == counts["succeeded"] == counts["completed"] == sizes[name]
        assert counts["failed"] == counts["expired"] == counts["cancelled"] == 0
        lines = api.get(f"/v1/batches/{batch_id}/results", headers=auth).data.splitlines()
        assert len(lines) == sizes[name]
        for line in lines:
            out = json.loads(line)
            assert out["error"] is None and out["response"]["status_code"] == 200
            text = out["response"]["body"]["choices"][0]["message"]["content"]
            # The simulator's answer starts with a digest of the very request it answered.
            expected = request_digest(prompts[(name, out["custom_id"])])
            assert text.startswith(f"[{expected}]"), (out["custom_id"], text[:40])

    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Result)) == 200
        ledger, results = usage_totals(UsageLedger), usage_totals(Result)
        assert tuple(ledger) == tuple(results)
        daily = s.execute(
            select(
                func.sum(TenantDailyUsage.requests),
                func.sum(TenantDailyUsage.prompt_tokens),
                func.sum(TenantDailyUsage.completion_tokens),
                func.sum(TenantDailyUsage.cost_usd),
                *(func.sum(getattr(TenantDailyUsage, k)) for k in TOKEN_KINDS),
            )
        ).one()
        assert tuple(daily) == tuple(results)
        assert (
            s.scalar(
                select(func.count())
                .select_from(UsageLedger)
                .where(UsageLedger.waste_reason.is_not(None))
            )
            == 0
        )
        assert s.scalar(select(func.max(Item.attempts))) == 1

    # Invariant 7: no prompt text in the worker's log.
    log_text = worker.log_path.read_text()
    assert "succeeded prompt_tokens=" in log_text  # the log is really there
    for messages in prompts.values():
        assert messages[0]["content"] not in log_text
