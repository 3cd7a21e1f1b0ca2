"""Retention (app/worker/retention_tick.py): finished batches past BATCHGEN_RETENTION_DAYS
go with their items, results and ledger rows, a few rows per transaction; the daily
usage totals stay, and nothing newer is touched."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, text

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.errors import NotFound
from batchgen.store import db, retention
from batchgen.store.schema import BatchNotification, Item, Result, TenantDailyUsage, UsageLedger
from batchgen.worker.retention_tick import purge
from bench import history
from tests.helpers import chat_line, make_tenant, wait_batches


def _count(table, *where) -> int:  # type: ignore[no-untyped-def]
    with db.session_scope() as session:
        return int(session.scalar(select(func.count()).select_from(table).where(*where)) or 0)


def _daily() -> tuple:
    with db.session_scope() as session:
        return tuple(
            session.execute(
                select(
                    func.sum(TenantDailyUsage.requests),
                    func.sum(TenantDailyUsage.prompt_tokens),
                    func.sum(TenantDailyUsage.cost_usd),
                )
            ).one()
        )


def test_old_batches_go_and_their_usage_history_stays(clean_db, simulator, workers, monkeypatch):
    make_tenant("kept")
    old = client.submit_batch([chat_line(f"o-{i}") for i in range(5)], tenant="kept")
    new = client.submit_batch([chat_line(f"n-{i}") for i in range(3)], tenant="kept")
    workers()
    wait_batches([old["id"], new["id"]], timeout_s=60)
    with db.session_scope() as session:
        session.execute(
            text("UPDATE batches SET finished_at = now() - interval '10 days' WHERE id = :id"),
            {"id": old["id"]},
        )
    daily = _daily()
    assert _count(Result, Result.batch_id == old["id"]) == 5

    assert purge(get_settings()).batches == 0  # no retention set: everything is kept
    monkeypatch.setenv("BATCHGEN_RETENTION_DAYS", "7")
    get_settings.cache_clear()
    monkeypatch.setattr(retention, "ITEMS_PER_TRANSACTION", 2)  # three transactions of items
    purged = purge(get_settings())

    assert (purged.batches, purged.items) == (1, 5)
    with pytest.raises(NotFound):
        client.get_batch(old["id"], tenant="kept")
    for table in (Item, Result, UsageLedger, BatchNotification):
        assert _count(table, table.batch_id == old["id"]) == 0, table
    assert client.get_batch(new["id"], tenant="kept")["request_counts"]["succeeded"] == 3
    assert _count(Result, Result.batch_id == new["id"]) == 3
    assert _daily() == daily  # usage and cost history survive
    assert client.usage(tenant="kept")[0]["requests"] == 8
    assert purge(get_settings()).batches == 0
    get_settings.cache_clear()


def _expired_calls(calls: int, monkeypatch: pytest.MonkeyPatch, **settings: str) -> None:
    """``calls`` finished synchronous calls (a batch of one item each, with its result
    and ledger row) twenty hours old, and retention at half a day with ``settings``."""
    libpq = get_settings().sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://")
    history.load(libpq, history.History(pending=0, finished=0, calls=calls))
    monkeypatch.setenv("BATCHGEN_RETENTION_DAYS", "0.5")
    for name, value in settings.items():
        monkeypatch.setenv(f"BATCHGEN_RETENTION_{name.upper()}", value)
    get_settings.cache_clear()


def test_one_tick_removes_more_than_a_chunk_within_its_budget(clean_db, monkeypatch):
    """A history that grows faster than one chunk per tick is not left behind: the tick
    goes on, chunk after chunk, until nothing expired is left."""
    _expired_calls(250, monkeypatch)  # two and a half chunks of the default 100
    try:
        purged = purge(get_settings())
        assert (purged.batches, purged.items) == (250, 250)
        assert not purged.budget_spent
        assert _count(Item) == 0
        assert _count(UsageLedger) == 0
    finally:
        get_settings.cache_clear()


def test_a_tick_stops_at_its_budget_and_the_next_goes_on(clean_db, monkeypatch):
    """A budget of 0 s: each tick removes the one chunk it started, and stops."""
    _expired_calls(5, monkeypatch, budget_s="0", chunk_batches="2")
    try:
        ticks = [purge(get_settings()) for _ in range(4)]
        assert [t.batches for t in ticks] == [2, 2, 1, 0]
        # The last of them was less than a chunk: nothing was left.
        assert [t.budget_spent for t in ticks] == [True, True, False, False]
        assert _count(Item) == 0
    finally:
        get_settings.cache_clear()


def test_a_bad_retention_setting_is_refused(monkeypatch):
    from pydantic import ValidationError

    from batchgen.config import Settings

    monkeypatch.setenv("BATCHGEN_RETENTION_DAYS", "0")
    with pytest.raises(ValidationError, match="BATCHGEN_RETENTION_DAYS"):
        Settings()


# The tables retention deletes from, whose rows other tables' foreign keys name.
PURGED = ("batches", "items", "provider_jobs")


def test_every_foreign_key_to_what_retention_removes_has_an_index(clean_db):
    """Removing a row makes PostgreSQL look for rows that still name it, in every table
    with a foreign key to it: without an index on the key's columns that look-up reads
    the whole table, once per row removed."""
    with db.session_scope() as session:
        keys = session.execute(
            text(
                """
                SELECT c.conrelid::regclass::text AS tbl, c.conname,
                       c.conkey::int2[] AS cols,
                       EXISTS (
                           SELECT 1 FROM pg_index AS x
                           WHERE x.indrelid = c.conrelid
                             AND (x.indkey::int2[])[0:cardinality(c.conkey) - 1]
                                 = c.conkey::int2[]
                       ) AS indexed
                FROM pg_constraint AS c
                WHERE c.contype = 'f' AND c.confrelid::regclass::text = ANY(:purged)
                """
            ),
            {"purged": list(PURGED)},
        ).all()
    assert len(keys) >= 9, keys  # results, ledger, jobs, job rows, notifications, ...
    assert [k.conname for k in keys if not k.indexed] == []
