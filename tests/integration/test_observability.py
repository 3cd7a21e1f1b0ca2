"""Metrics, usage and logs agree with the database and never carry prompt text."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from batchgen.api import create_app
from batchgen.store import db
from batchgen.store.schema import Item, Result, UsageLedger
from tests.helpers import chat_line, jsonl, make_tenant, usage_totals, wait_batches
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

PROMPT = "Confidential roadmap item number"
METRICS_TOKEN = "scrape-token-for-tests"


@pytest.fixture(autouse=True)
def _metrics_token(monkeypatch):
    """/metrics is never open: the scrapes below present the metrics token."""
    from batchgen.config import get_settings

    monkeypatch.setattr(get_settings().api, "metrics_token", METRICS_TOKEN)


def _scrape(api) -> dict[tuple[str, tuple], float]:
    res = api.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert res.status_code == 200
    assert PROMPT not in res.text
    samples = {}
    for family in text_string_to_metric_families(res.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _started() -> bool:
    with db.session_scope() as s:
        return bool(
            s.scalar(
                select(func.count())
                .select_from(Item)
                .where(Item.status.in_(["running", "succeeded", "failed"]))
            )
        )


@pytest.mark.slow
def test_metrics_match_the_database_across_two_workers(clean_db, simulator, workers):
    api = create_app().test_client()
    keys = {t: make_tenant(t) for t in ("red", "blue")}
    batch_ids = []
    for t, n in (("red", 30), ("blue", 20)):
        rows = [
            chat_line(
                f"{t}{i}", model="sim-small" if i % 2 else "sim-large", text=f"{PROMPT} {t}-{i}"
            )
            for i in range(n)
        ]
        res = api.post(
            "/v1/batches", data=jsonl(rows), headers={"Authorization": f"Bearer {keys[t]}"}
        )
        batch_ids.append(res.json["id"])
    workers(concurrency=4, name="one")
    workers(concurrency=4, name="two", beat=False)
    wait_until(_started, 60, "the workers to begin on the batches", 0.02)
    mid = _scrape(api)  # while the batch runs: every item is somewhere
    in_states = sum(v for (name, labels), v in mid.items() if name == "batchgen_items")
    assert in_states == 50
    wait_batches(batch_ids)

    m = _scrape(api)
    with db.session_scope() as s:
        per_model = dict(
            s.execute(
                select(Item.model, func.count())
                .where(Item.status == "succeeded")
                .group_by(Item.model)
            ).all()
        )
        ledger = dict(
            s.execute(
                select(UsageLedger.tenant_id, func.sum(UsageLedger.prompt_tokens)).group_by(
                    UsageLedger.tenant_id
                )
            ).all()
        )
        results = s.scalar(select(func.count()).select_from(Result))
    for model, n in per_model.items():
        assert m[("batchgen_items", (("model", model), ("status", "succeeded")))] == n
        assert m[("batchgen_upstream_latency_seconds_count", (("model", model),))] == n
        assert m[("batchgen_queue_wait_seconds_count", (("model", model),))] == n
    assert sum(per_model.values()) == results == 50
    for tenant, n in (("red", 30), ("blue", 20)):
        assert m[("batchgen_tenant_items_accepted_total", (("tenant", tenant),))] == n
        assert (
            m[
                (
                    "batchgen_tenant_items_finished_total",
                    (("status", "succeeded"), ("tenant", tenant)),
                )
            ]
            == n
        )
    prompt_tokens = sum(
        v
        for (name, labels), v in m.items()
        if name == "batchgen_tenant_tokens_total" and ("kind", "prompt") in labels
    )
    assert prompt_tokens == sum(ledger.values())
    assert m[("batchgen_concurrency_limit", (("model", "sim-small"),))] == 16


def test_rejections_are_counted_per_tenant_and_reason(clean_db):
    api = create_app().test_client()
    key = make_tenant("picky", max_pending_items=1)
    auth = {"Authorization": f"Bearer {key}"}
    assert api.post("/v1/batches", data=b"{bad", headers=auth).status_code == 400
    assert (
        api.post(
            "/v1/batches", data=jsonl([chat_line("a"), chat_line("b")]), headers=auth
        ).status_code
        == 429
    )
    m = _scrape(api)
    assert (
        m[
            (
                "batchgen_tenant_items_rejected_total",
                (("reason", "invalid_request"), ("tenant", "picky")),
            )
        ]
        == 1
    )
    assert (
        m[
            (
                "batchgen_tenant_items_rejected_total",
                (("reason", "tenant_over_quota"), ("tenant", "picky")),
            )
        ]
        == 1
    )


def test_usage_endpoint_matches_the_ledger_and_is_tenant_scoped(clean_db, simulator, workers):
    api = create_app().test_client()
    key = make_tenant("payer")
    other = make_tenant("nosy")
    admin = make_tenant("ops", is_admin=True)
    res = api.post(
        "/v1/batches",
        data=jsonl([chat_line(f"u{i}") for i in range(12)]),
        headers={"Authorization": f"Bearer {key}"},
    )
    workers(concurrency=4)
    wait_batches([res.json["id"]])
    usage = api.get("/v1/usage?group_by=model", headers={"Authorization": f"Bearer {key}"}).json
    total = usage_totals(UsageLedger)
    [row] = usage["data"]
    assert (row["model"], row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
        "sim-small",
        total[0],
        total[1],
        total[2],
    )
    assert row["cost_usd"] == str(total[3])
    by_day = api.get("/v1/usage?group_by=day", headers={"Authorization": f"Bearer {key}"}).json
    assert sum(r["requests"] for r in by_day["data"]) == 12
    assert api.get("/v1/usage", headers={"Authorization": f"Bearer {other}"}).json["data"] == []
    assert (
        api.get("/v1/usage?tenant=all", headers={"Authorization": f"Bearer {key}"}).status_code
        == 403
    )
    everyone = api.get(
        "/v1/usage?tenant=all&group_by=tenant", headers={"Authorization": f"Bearer {admin}"}
    ).json["data"]
    assert [(r["tenant"], r["requests"]) for r in everyone] == [("payer", 12)]
    assert (
        api.get("/v1/usage?from=2026-13-01", headers={"Authorization": f"Bearer {key}"}).status_code
        == 400
    )
    status = api.get("/v1/status", headers={"Authorization": f"Bearer {admin}"})
    assert status.status_code == 200
    assert {m["model"] for m in status.json["models"]} >= {"sim-small", "sim-large"}
    assert api.get("/v1/status", headers={"Authorization": f"Bearer {key}"}).status_code == 403


def test_json_logs_carry_no_prompt_text(clean_db, simulator, workers, caplog):
    make_tenant("quiet")
    api = create_app().test_client()
    key = make_tenant("loud")
    rows = [chat_line(f"l{i}", text=f"{PROMPT} {i} about the secret merger") for i in range(10)]
    rows.append(chat_line("bad", text=f"{PROMPT} too long " + "word " * 20000))
    assert (
        api.post(
            "/v1/batches", data=jsonl(rows), headers={"Authorization": f"Bearer {key}"}
        ).status_code
        == 400
    )
    res = api.post("/v1/batches", data=jsonl(rows[:10]), headers={"Authorization": f"Bearer {key}"})
    worker = workers(
        concurrency=4, env={"BATCHGEN_LOG_JSON": "true", "BATCHGEN_LOG_LEVEL": "DEBUG"}
    )
    wait_batches([res.json["id"]])
    out = api.get(
        f"/v1/batches/{res.json['id']}/results", headers={"Authorization": f"Bearer {key}"}
    ).data
    assert out.count(b"\n") == 10
    lines = worker.log_path.read_text().splitlines()
    parsed = [json.loads(line) for line in lines if line.startswith("{")]
    assert any("succeeded" in p["message"] for p in parsed)
    assert all({"levelname", "name", "message"} <= p.keys() for p in parsed)
    everything = "\n".join(lines) + "\n".join(r.getMessage() for r in caplog.records)
    assert PROMPT not in everything and "secret merger" not in everything
