"""Deadlines cover the whole life of an item; a cancel stops upstream calls for real."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import func, select

from batchgen import python_api as client
from batchgen.store import db
from batchgen.store.schema import Item
from tests import http_client
from tests.helpers import chat_line, make_tenant, wait_batches
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

FAST_SWEEP = {"BATCHGEN_SWEEP_INTERVAL_S": "0.5"}
# A request the worker marked as sent just before the cancel committed may
# still be on its way over loopback when the cancel returns.
IN_TRANSIT_S = 0.25


def _sim_log(sim) -> list[dict]:
    return http_client.get(f"{sim.base_url}/_sim/log", params={"limit": 100_000}).json()


def _set_latency(sim, ms: float, per_token_ms: float = 0.5) -> None:
    http_client.post(
        f"{sim.base_url}/_sim/config",
        json={"latency_base_ms": ms, "latency_per_token_ms": per_token_ms},
    ).raise_for_status()


def _item_ids(batch_id: str, tenant: str) -> set[str]:
    return {
        row["id"].removeprefix("batch_req_") for row in client.iter_results(batch_id, tenant=tenant)
    }


def _wait_past_deadline(batch_id: str, *, every_item: bool, timeout_s: float = 30) -> None:
    """Wait until the database's clock is past the deadline of every item of the batch
    (or of its first item to expire)."""
    deadline = func.max(Item.deadline_at) if every_item else func.min(Item.deadline_at)
    query = select(func.now() > deadline).where(Item.batch_id == batch_id)

    def passed() -> bool:
        with db.session_scope() as s:
            return bool(s.scalar(query))

    wait_until(passed, timeout_s, "the deadline to pass", 0.05)


def test_item_past_its_deadline_never_reaches_the_provider(clean_db, simulator, workers):
    make_tenant("late")
    http_client.post(f"{simulator.base_url}/_sim/reset").raise_for_status()
    batch = client.submit_batch(
        [chat_line(f"d{i}") for i in range(10)], tenant="late", completion_window="1s"
    )
    # Queue time counts: no worker runs while every item's deadline passes.
    _wait_past_deadline(batch["id"], every_item=True)
    workers(concurrency=4, env=FAST_SWEEP)
    wait_batches([batch["id"]], timeout_s=30)
    info = client.get_batch(batch["id"], tenant="late")
    assert info["request_counts"]["expired"] == 10
    assert info["status"] == "expired"  # every item expired: none of it ran
    ids = _item_ids(batch["id"], "late")
    assert not [e for e in _sim_log(simulator) if e.get("item") in ids]


def test_per_item_timeout_expires_only_that_item(clean_db, simulator, workers):
    make_tenant("mixed")
    rows = [chat_line(f"t{i}") for i in range(5)]
    rows[0]["timeout"] = "1s"
    batch = client.submit_batch(rows, tenant="mixed")
    _wait_past_deadline(batch["id"], every_item=False)  # t0's 1 s
    workers(concurrency=4, env=FAST_SWEEP)
    wait_batches([batch["id"]], timeout_s=30)
    counts = client.get_batch(batch["id"], tenant="mixed")["request_counts"]
    assert (counts["expired"], counts["succeeded"]) == (1, 4)
    errors = {r["custom_id"]: r["error"] for r in client.iter_results(batch["id"], tenant="mixed")}
    assert errors["t0"]["code"] == "expired" and errors["t1"] is None


def _cancel_mid_run(sim, tenant: str, n: int = 40):
    batch = client.submit_batch(
        [chat_line(f"c{i}", max_tokens=200) for i in range(n)], tenant=tenant
    )
    wait_until(
        lambda: sum(1 for e in _sim_log(sim) if e.get("end_ts") is None) >= 3,
        30,
        "calls under way",
        0.05,
    )
    return batch


def test_cancel_aborts_running_calls_and_sends_nothing_after(clean_db, simulator, workers):
    make_tenant("canceller")
    # Long answers streamed slowly: 0.3 s to the first token, then 60 ms a token (a
    # loaded machine takes seconds to see the cancel; the calls must still be running).
    _set_latency(simulator, 300, per_token_ms=60)
    try:
        workers(concurrency=8)
        batch = _cancel_mid_run(simulator, "canceller")
        client.cancel_batch(batch["id"], tenant="canceller")
        cancelled_at = time.time()
        wait_batches([batch["id"]], timeout_s=30)
    finally:
        _set_latency(simulator, 50)
    ids = _item_ids(batch["id"], "canceller")
    entries = [e for e in _sim_log(simulator) if e.get("item") in ids]
    assert entries and all(e["start_ts"] <= cancelled_at + IN_TRANSIT_S for e in entries)
    aborted = [e for e in entries if e["completed"] is False]
    assert aborted, "the running calls should have been aborted"
    # They stopped after the cancel sooner than any answer takes whole, mid-answer (the
    # stream was closed): 0.3 s + 200 tokens x 20 ms.
    answer_s = 0.3 + 200 * 0.020
    assert all(e["end_ts"] - cancelled_at < answer_s for e in aborted)
    info = client.get_batch(batch["id"], tenant="canceller")
    assert info["status"] == "cancelled"
    assert info["request_counts"]["cancelled"] >= 40 - len(entries)
    # Partial results stay downloadable, one line per finished item.
    rows = list(client.iter_results(batch["id"], tenant="canceller"))
    assert len(rows) == 40
    assert json.dumps(rows)  # serialisable as the results file


@pytest.mark.slow
def test_cancel_holds_across_a_worker_restart(clean_db, simulator, workers):
    make_tenant("restart")
    _set_latency(simulator, 1500)
    env = {
        "BATCHGEN_CALL_TIMEOUT_S": "3",
        "BATCHGEN_RUNNING_LEASE_MARGIN_S": "1",
        "BATCHGEN_QUEUED_LEASE_S": "3",
        **FAST_SWEEP,
    }
    try:
        first = workers(concurrency=8, env=env, name="first")
        batch = _cancel_mid_run(simulator, "restart")
        first.kill()  # dies holding running items and prefetched messages
        client.cancel_batch(batch["id"], tenant="restart")
        cancelled_at = time.time()
        workers(concurrency=8, env=env, name="second")
        wait_batches([batch["id"]], timeout_s=60)
    finally:
        _set_latency(simulator, 50)
    ids = _item_ids(batch["id"], "restart")
    assert not [
        e for e in _sim_log(simulator) if e.get("item") in ids and e["start_ts"] > cancelled_at
    ]
    info = client.get_batch(batch["id"], tenant="restart")
    assert info["status"] == "cancelled"
    assert info["request_counts"]["succeeded"] == 0


def test_sweep_cancels_items_a_retry_left_in_a_cancelled_batch(clean_db):
    """A retry that raced with the cancel put an item back to pending: it never runs."""
    from sqlalchemy import update

    from batchgen.config import get_settings
    from batchgen.store import db
    from batchgen.store.schema import Item
    from batchgen.worker.sweep import sweep

    make_tenant("racer")
    batch = client.submit_batch([chat_line(f"o{i}") for i in range(3)], tenant="racer")
    client.cancel_batch(batch["id"], tenant="racer")
    with db.session_scope() as s:  # what the losing side of the race leaves behind
        s.execute(
            update(Item).where(Item.custom_id == "o0").values(status="pending", finished_at=None)
        )
    with db.session_scope() as s:
        sweep(s, get_settings())
    counts = client.get_batch(batch["id"], tenant="racer")["request_counts"]
    assert counts["cancelled"] == 3 and counts["pending"] == 0
