"""The maintained totals (app/store/totals.py) that metrics, the status view and
admission read: they equal a count of the items one by one through every way an item
ends, across roll-ups, and after retention; and the scans of the dispatcher, the
sweep and the totals use their indexes on a large bulk-loaded history."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import text

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.registry import get_registry
from batchgen.store import db, rounds, totals
from batchgen.worker.retention_tick import purge
from batchgen.worker.sweep import sweep
from bench import history
from tests.helpers import chat_line, make_tenant, wait_batches
from tests.invariants import check_totals


def _finished_by_status() -> dict[str, int]:
    with db.session_scope() as session:
        found: dict[str, int] = {}
        for (_, _, status), count in totals.finished(session).items():
            found[status] = found.get(status, 0) + count.items
        return found


def test_totals_equal_a_count_of_the_items_through_every_end(
    clean_db, simulator, workers, monkeypatch
):
    make_tenant("shop-a")
    make_tenant("shop-b")
    cancelled = client.submit_batch([chat_line(f"c-{i}") for i in range(4)], tenant="shop-a")
    client.cancel_batch(cancelled["id"], tenant="shop-a")
    late = client.submit_batch([chat_line(f"l-{i}") for i in range(3)], tenant="shop-b")
    with db.session_scope() as session:
        session.execute(
            text("UPDATE items SET deadline_at = now() - interval '1 second' WHERE batch_id = :b"),
            {"b": late["id"]},
        )
        sweep(session, get_settings())  # the late ones expire, never sent
    waiting = client.submit_batch([chat_line(f"w-{i}") for i in range(5)], tenant="shop-b")
    assert _finished_by_status() == {"cancelled": 4, "expired": 3}  # all in the tail

    # Items that ended ten minutes ago are behind the roll-up's lag: they move into the
    # rolled-up tables, and the totals still equal the count (check_totals then rolls
    # up everything, with no lag, and checks again).
    with db.session_scope() as session:
        session.execute(
            text(
                "UPDATE items SET finished_at = now() - interval '10 minutes' "
                "WHERE finished_at IS NOT NULL"
            )
        )
    with db.session_scope() as session:
        assert totals.roll_up(session)
    with db.session_scope() as session:
        rolled = session.execute(text("SELECT sum(items) FROM finished_totals")).scalar()
    assert rolled == 7
    check_totals()

    done = client.submit_batch([chat_line(f"d-{i}") for i in range(6)], tenant="shop-a")
    workers()
    wait_batches([done["id"], waiting["id"]], timeout_s=60)
    check_totals()
    assert _finished_by_status() == {"succeeded": 11, "cancelled": 4, "expired": 3}

    # Retention removes the old batches' rows; what they counted stays counted.
    with db.session_scope() as session:
        session.execute(
            text("UPDATE batches SET finished_at = now() - interval '10 days' WHERE id = :b"),
            {"b": done["id"]},
        )
    monkeypatch.setenv("BATCHGEN_RETENTION_DAYS", "7")
    get_settings.cache_clear()
    assert purge(get_settings()).items == 6
    get_settings.cache_clear()
    assert _finished_by_status() == {"succeeded": 11, "cancelled": 4, "expired": 3}
    with db.session_scope() as session:
        open_now = totals.total(totals.open_counts(session, get_registry().names))
    assert open_now.items == 0


def test_admission_counts_what_is_open_not_what_ever_was(clean_db, monkeypatch):
    """The tenant's open-items bound reads admitted − finished: finished items, rolled
    up or not, no longer count against it."""
    from batchgen.errors import OverQuota

    make_tenant("capped", max_pending_items=5)
    first = client.submit_batch([chat_line(f"a-{i}") for i in range(5)], tenant="capped")
    try:
        client.submit_batch([chat_line("one-more")], tenant="capped")
    except OverQuota:
        pass
    else:
        raise AssertionError("a sixth open item was admitted")
    client.cancel_batch(first["id"], tenant="capped")
    with db.session_scope() as session:
        assert totals.roll_up(session, lag_s=0)
    again = client.submit_batch([chat_line(f"b-{i}") for i in range(5)], tenant="capped")
    assert again["request_counts"]["total"] == 5
    check_totals()


# Rows of bulk-loaded history for the plan test: BATCHGEN_PLAN_TEST_ITEMS, else 100k
# (bench/scale.py runs the same check at two million).
PLAN_TEST_ITEMS = int(os.environ.get("BATCHGEN_PLAN_TEST_ITEMS", "100000"))


@pytest.mark.slow
def test_the_scans_use_their_indexes_on_a_large_history(clean_db):
    url = get_settings().sqlalchemy_url
    libpq = url.replace("postgresql+psycopg://", "postgresql://")
    history.load(
        libpq,
        history.History(
            pending=PLAN_TEST_ITEMS // 2,
            finished=PLAN_TEST_ITEMS // 2,
            deferred=True,
            calls=PLAN_TEST_ITEMS // 20,
        ),
    )
    found = history.plans(url)
    assert set(found) == set(history.PLANNED)
    large = history.LARGE_TABLES
    whole = {label: history.seq_scans_of_items(plan, large) for label, plan in found.items()}
    assert not any(whole.values()), whole
    assert "ix_items_pending_by_model" in found["dispatch: ring of tenants"]
    assert "ix_items_pending_by_model" in found["dispatch: release picks"]
    assert "ix_items_deferred" in found["deferred items due"]
    for name in ("ix_items_pending_by_model", "ix_items_deferred"):
        assert name in found["dispatch: models with work"], found["dispatch: models with work"]
    assert "ix_items_unstarted_deadline" in found["sweep: expired deadlines"]
    assert "ix_items_finished_at" in found["totals: finished"]
    assert "ix_batches_finished_at" in found["retention: expired batches"]
    for name in ("ix_usage_ledger_batch_id", "pk_batches"):
        assert name in found["retention: the batch row"], found["retention: the batch row"]
    assert "uq_usage_ledger_item_id_attempt" in found["retention: a batch's items"]

    # Every pending item is deferred: a round releases nothing. Ten of them come due:
    # the round makes them ready and releases them.
    with db.session_scope() as session:
        assert rounds.release(session, history.MODEL, 16, 60) == []
    with db.session_scope() as session:
        session.execute(
            text(
                "UPDATE items SET not_before = now() - interval '1 second' WHERE id IN "
                "(SELECT id FROM items WHERE status = 'pending' ORDER BY id LIMIT 10)"
            )
        )
    with db.session_scope() as session:
        released = rounds.release(session, history.MODEL, 16, 60)
    assert len(released) == 10
