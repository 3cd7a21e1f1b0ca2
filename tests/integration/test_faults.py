"""Faults: duplicate deliveries and a SIGKILLed worker lose nothing and count nothing twice."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from batchgen import python_api as client
from batchgen import tenant_admin
from batchgen.config import get_settings
from batchgen.limits.backend import get_redis
from batchgen.limits.gate import Gate
from batchgen.registry import get_registry
from batchgen.store import db
from batchgen.store.items import claim
from batchgen.store.ledger import CallOutcome, record_success
from batchgen.store.schema import Item, Result, UsageLedger
from batchgen.worker.dispatch import release_all
from batchgen.worker.execution import run_item
from tests import http_client
from tests.helpers import (
    assert_ledger_is_results_plus_waste,
    chat_line,
    make_tenant,
    wait_batches,
)
from tests.invariants import assert_budget_settled
from tests.waiting import hold, poll_until, wait_until

pytestmark = pytest.mark.integration


def test_same_task_delivered_twice_records_once(clean_db, simulator, workers):
    from batchgen.tasks.generate import generate

    make_tenant("dup")
    batch = client.submit_batch([chat_line(f"d{i}") for i in range(20)], tenant="dup")
    with db.session_scope() as s:
        released = release_all(s, get_registry(), get_settings())
    assert len(released) == 20
    for r in released:  # every message published twice, as a broker redelivery would
        generate.apply_async(args=[r.item_id], kwargs={"model": r.model})
        generate.apply_async(args=[r.item_id], kwargs={"model": r.model})
    workers(concurrency=8)
    wait_batches([batch["id"]])
    # A third, late delivery of one of them, run right here.
    gate = Gate(get_redis(), get_settings())
    verdict = run_item(released[0].item_id, get_registry(), get_settings(), gate)
    assert verdict.outcome == "skipped"

    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Result)) == 20
        assert s.scalar(select(func.count()).select_from(UsageLedger)) == 20
        assert s.scalar(select(func.max(Item.attempts))) == 1
    stats = http_client.get(f"{simulator.base_url}/_sim/stats").json()
    assert stats["requests"] >= 20
    assert_ledger_is_results_plus_waste()


def test_two_attempts_finishing_record_one_result_and_mark_waste(clean_db):
    make_tenant("race")
    client_batch = client.submit_batch([chat_line("r0")], tenant="race")
    spec = get_registry()["sim-small"]
    with db.session_scope() as s:
        release_all(s, get_registry(), get_settings())
        first = claim(s, s.scalar(select(Item.id)), lease_s=60)
    assert first is not None

    def outcome(attempt: int) -> CallOutcome:
        return CallOutcome(
            item_id=first.item_id,
            attempt=attempt,
            prompt_tokens=10,
            completion_tokens=20,
            response={"choices": []},
            provider_request_id=f"req-{attempt}",
            upstream_latency_ms=5,
            queue_wait_ms=1,
        )

    with db.session_scope() as s:
        assert record_success(s, outcome(1), spec) is True
    with db.session_scope() as s:  # the same attempt again: nothing new at all
        assert record_success(s, outcome(1), spec) is False
    with db.session_scope() as s:  # a second attempt that also reached the provider
        assert record_success(s, outcome(2), spec) is False
    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Result)) == 1
        rows = s.execute(
            select(UsageLedger.attempt, UsageLedger.waste_reason).order_by(UsageLedger.attempt)
        ).all()
    assert rows == [(1, None), (2, "item_already_succeeded")]
    assert_ledger_is_results_plus_waste()
    assert client.get_batch(client_batch["id"], tenant="race")["request_counts"]["succeeded"] == 1


@pytest.mark.slow
def test_sigkill_worker_mid_call_loses_nothing(clean_db, simulator, workers):
    fast_leases = {
        "BATCHGEN_CALL_TIMEOUT_S": "5",
        "BATCHGEN_RUNNING_LEASE_MARGIN_S": "1",
        "BATCHGEN_QUEUED_LEASE_S": "8",
        "BATCHGEN_SWEEP_INTERVAL_S": "1",
    }
    http_client.post(
        f"{simulator.base_url}/_sim/config", json={"latency_base_ms": 700}
    ).raise_for_status()
    try:
        make_tenant("kill")
        tenant_admin.set_budget("kill", limit_usd="100", period="total")  # ample: never refuses
        batch = client.submit_batch([chat_line(f"k{i}") for i in range(60)], tenant="kill")
        victim = workers(
            get_registry().queues, concurrency=8, beat=False, env=fast_leases, name="victim"
        )
        workers(concurrency=8, beat=True, env=fast_leases, name="survivor")
        poll_until(lambda: "succeeded prompt_tokens" in victim.log_tail(200), 30)
        hold(0.3, "the victim's threads are mid-call (700 ms each) now")
        victim.kill()
        wait_batches([batch["id"]], timeout_s=120)
    finally:
        http_client.post(f"{simulator.base_url}/_sim/config", json={"latency_base_ms": 50})

    info = client.get_batch(batch["id"], tenant="kill")
    assert info["request_counts"]["succeeded"] == 60
    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Result)) == 60
        assert s.scalar(select(func.count(func.distinct(Result.item_id)))) == 60
        recorded = s.scalar(
            select(func.count()).select_from(UsageLedger).where(UsageLedger.waste_reason.is_(None))
        )
        retried = s.scalar(select(func.count()).select_from(Item).where(Item.attempts > 1))
    assert recorded == 60
    assert retried > 0  # the kill really hit items in flight
    assert_ledger_is_results_plus_waste()
    assert_budget_settled("kill")


def test_provider_error_storm_retries_through_the_dispatcher(clean_db, simulator, workers):
    """30 % of calls fail with 5xx, timeouts or resets: every item still succeeds, retried
    with backoff through PostgreSQL, and nothing is counted twice."""
    faults = {"fault_rate": 0.3, "fault_kinds": ["5xx", "reset", "malformed"]}
    http_client.post(f"{simulator.base_url}/_sim/config", json=faults).raise_for_status()
    try:
        make_tenant("storm")
        batch = client.submit_batch([chat_line(f"s{i}") for i in range(40)], tenant="storm")
        workers(concurrency=8, env={"BATCHGEN_RETRY_BASE_S": "0.05", "BATCHGEN_MAX_ATTEMPTS": "12"})
        wait_batches([batch["id"]], timeout_s=90)
    finally:
        http_client.post(f"{simulator.base_url}/_sim/config", json={"fault_rate": 0.0})
    counts = client.get_batch(batch["id"], tenant="storm")["request_counts"]
    assert counts["succeeded"] == 40
    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Result)) == 40
        assert s.scalar(select(func.max(Item.attempts))) > 1
        # Resets and malformed answers came after the request was sent: maybe billed,
        # so they are in the ledger, as waste.
        assert (
            s.scalar(
                select(func.count())
                .select_from(UsageLedger)
                .where(UsageLedger.waste_reason.like("failed_%"))
            )
            > 0
        )
    assert_ledger_is_results_plus_waste()


FAST_RECOVERY = {
    "BATCHGEN_CALL_TIMEOUT_S": "5",
    "BATCHGEN_RUNNING_LEASE_MARGIN_S": "1",
    "BATCHGEN_QUEUED_LEASE_S": "3",
    "BATCHGEN_SWEEP_INTERVAL_S": "0.5",
    # A Redis that lost the gate's state restarts its budgets as spent for one window
    # (app/worker/gate_recovery.py): a short window keeps that wait short.
    "BATCHGEN_BUDGET_WINDOW_S": "5",
}


def _wait_until_running(batch_id: str, at_least: int = 5) -> None:
    wait_until(
        lambda: (
            client.get_batch(batch_id, tenant=_tenant_of(batch_id))["request_counts"]["succeeded"]
            >= at_least
        ),
        30,
        "the batch to start",
        poll_s=0.05,
    )


def _tenant_of(batch_id: str) -> str:
    from batchgen.store.schema import Batch, Tenant

    with db.session_scope() as s:
        return s.scalar(select(Tenant.name).join(Batch).where(Batch.id == batch_id))


@pytest.mark.slow
def test_flushed_redis_loses_no_item(clean_db, simulator, workers):
    """Redis restarted empty mid-run: broker messages, budgets and slots are gone;
    PostgreSQL still knows every item and the sweep re-releases them."""
    make_tenant("flushed")
    batch = client.submit_batch([chat_line(f"r{i}") for i in range(80)], tenant="flushed")
    workers(concurrency=8, env=FAST_RECOVERY)
    _wait_until_running(batch["id"])
    get_redis().flushdb()
    wait_batches([batch["id"]], timeout_s=90)
    assert client.get_batch(batch["id"], tenant="flushed")["request_counts"]["succeeded"] == 80
    with db.session_scope() as s:
        assert s.scalar(select(func.count(func.distinct(Result.item_id)))) == 80
    assert_ledger_is_results_plus_waste()


def test_terminated_postgres_backends_lose_no_item(clean_db, simulator, workers):
    """Every database connection of the workers is killed mid-run (a failover)."""
    from sqlalchemy import text

    make_tenant("failover")
    batch = client.submit_batch([chat_line(f"p{i}") for i in range(80)], tenant="failover")
    workers(concurrency=8, env=FAST_RECOVERY)
    _wait_until_running(batch["id"])
    with db.session_scope() as s:
        killed = s.scalar(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )
    assert killed > 0
    wait_batches([batch["id"]], timeout_s=90)
    assert client.get_batch(batch["id"], tenant="failover")["request_counts"]["succeeded"] == 80
    with db.session_scope() as s:
        assert s.scalar(select(func.count(func.distinct(Result.item_id)))) == 80
    assert_ledger_is_results_plus_waste()
