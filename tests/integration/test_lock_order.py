"""Lock order of the writers of an item and its ledger (issue #27 item 13).

Every transaction that moves an item and ledgers a call locks the item row before
the ledger's daily-totals row, which many items share. A failed call's transaction
(:func:`batchgen.worker.failures.failed`: waste row, then the item's move) used to
take the daily row first, and deadlocked against a writer that holds the item and
ledgers another item of the same daily row (the sweep: its UPDATE locks every lost
item, then it ledgers their calls). Real PostgreSQL, two real transactions.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
from sqlalchemy import select, text

from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.registry import get_registry
from batchgen.store import db, items
from batchgen.store.ledger import CallOutcome, record_lost_call, record_waste
from batchgen.store.schema import DAILY_USAGE_SHARDS, Item, UsageLedger
from batchgen.worker.recording import with_db_retries
from tests.helpers import submit_items
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class _Attempt:
    item_id: int
    attempt: int = 1

    def lease_left_s(self) -> float:
        return 60.0


def _two_running_items_of_one_daily_row(batch_id: str) -> tuple[int, int]:
    """Two items of the batch in the same shard of the daily totals, made running and
    sent on attempt 1."""
    with db.session_scope() as session:
        # In id order: the smallest, and the one a whole round of shards after it.
        ids = list(
            session.scalars(select(Item.id).where(Item.batch_id == batch_id).order_by(Item.id))
        )
        first = ids[0]
        second = next(i for i in ids[1:] if i % DAILY_USAGE_SHARDS == first % DAILY_USAGE_SHARDS)
        session.execute(
            text(
                "UPDATE items SET status = 'running', attempts = 1, started_at = now(),"
                " sent_at = now(), lease_expires_at = now() + interval '60 seconds'"
                " WHERE id = ANY(:ids)"
            ),
            {"ids": [first, second]},
        )
    return first, second


def _waits_on_a_lock(application_name: str) -> bool:
    with db.autocommit() as connection:
        return bool(
            connection.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE application_name = :name AND wait_event_type = 'Lock'"
                ),
                {"name": application_name},
            )
        )


def test_a_failed_calls_waste_row_waits_for_the_item_before_the_daily_row(clean_db):
    batch_id = submit_items("lockorder", DAILY_USAGE_SHARDS + 2)
    held, other = _two_running_items_of_one_daily_row(batch_id)
    with db.session_scope() as session:
        spec = get_registry().get(session.scalar(select(Item.model).where(Item.id == held)))
    assert spec is not None
    errors: list[BaseException] = []

    def failed_call() -> None:
        """What failures.failed writes for a billed 5xx that ends the item."""
        try:
            with db.session_scope() as session:
                session.execute(text("SET application_name = 'failed-call'"))
                waste = CallOutcome(item_id=held, attempt=1, prompt_tokens=10)
                record_waste(session, waste, spec, "failed_server_error")
                items.finish(session, _Attempt(held), ItemStatus.FAILED, "server_error", "5xx")
        except BaseException as exc:  # noqa: BLE001 - reported to the test's thread
            errors.append(exc)

    with db.session_scope() as sweep:  # the sweep: holds the lost item, ledgers another
        sweep.execute(text("SET deadlock_timeout = '100ms'"))
        assert items.lock(sweep, held) is not None
        thread = threading.Thread(target=failed_call)
        thread.start()
        wait_until(
            lambda: _waits_on_a_lock("failed-call"), 20, "the failed call's transaction to block"
        )
        record_lost_call(sweep, other, 1, get_registry())  # the daily row the other wants
    thread.join(30)

    assert not thread.is_alive()
    assert not errors, f"the failed call's transaction raised: {errors!r}"
    with db.session_scope() as session:
        rows = session.execute(
            select(UsageLedger.item_id, UsageLedger.waste_reason).order_by(UsageLedger.item_id)
        ).all()
        status = session.scalar(select(Item.status).where(Item.id == held))
    assert sorted(rows) == sorted([(held, "failed_server_error"), (other, "worker_lost")])
    assert status == "failed"


def test_a_transaction_aborted_by_a_deadlock_runs_again_even_past_the_lease(clean_db):
    """with_db_retries runs a deadlocked transaction again at once, lease or none."""

    @dataclass(frozen=True)
    class Expired(_Attempt):
        def lease_left_s(self) -> float:
            return -1.0

    runs: list[int] = []

    def work(session) -> int:  # type: ignore[no-untyped-def]
        runs.append(1)
        if len(runs) == 1:  # a real 40P01 from PostgreSQL, raised in the transaction
            session.execute(
                text(
                    "DO $$ BEGIN RAISE EXCEPTION 'deadlock detected'"
                    " USING ERRCODE = 'deadlock_detected'; END $$"
                )
            )
        return int(session.scalar(text("SELECT 7")))

    assert with_db_retries(Expired(1), "testing", work) == 7
    assert len(runs) == 2
