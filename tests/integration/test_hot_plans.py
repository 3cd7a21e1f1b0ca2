"""The hot path's pack statements find items by their primary key on statistics
taken while the tables were empty.

Statistics taken while the table was empty (a fresh database, a quiet night before a
large batch) once made the claim join the batch first and scan the batch's items for
every item claimed (70 ms for a pack of 32 of a 2 000-item batch), and the group
commit scan the queue's partial indexes. Here the statistics are taken on empty
tables, 2 000 items are submitted and released, and the plans of the claim and the
group commit of 32 of them are read (EXPLAIN, nothing run): every scan of ``items``
is an index scan of its primary key. So are the plans of the statements that hold a
pack's queued leases and renew a worker's running ones, for hundreds of items in a
table with a history (the heartbeat's renewal once filtered every running item through
an OR per pair: a second of PostgreSQL's time for 330 of them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.registry import parse_registry
from batchgen.store import db, items
from batchgen.store.items import ANSWER_COLUMNS
from batchgen.store.schema import Item
from batchgen.store.sqlfiles import source
from batchgen.worker.dispatch import release_model
from tests.helpers import chat_line, make_tenant, truncate_tables

pytestmark = pytest.mark.integration

MODEL = "sim-small"
BATCH_INDEX = "ix_items_batch_id_status_line_no"


def _scans(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if "Relation Name" in plan and plan["Node Type"] != "ModifyTable":
        yield plan
    for child in plan.get("Plans", ()):
        yield from _scans(child)


@pytest.fixture
def explained(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The plans of the statements run through ``db.driver_rows``, in place of running them."""
    plans: list[dict[str, Any]] = []

    def explain(connection: Any, statement: str, params: Any) -> list[Any]:
        driver: Any = connection.connection.driver_connection
        with driver.cursor() as cursor:
            cursor.execute("EXPLAIN (FORMAT JSON) " + statement, params)
            (found,) = cursor.fetchone()
        plans.append(found[0]["Plan"] if isinstance(found, list) else json.loads(found)[0]["Plan"])
        return []

    monkeypatch.setattr(db, "driver_rows", explain)
    return plans


@pytest.fixture(autouse=True)
def _statistics_kept_as_analyzed() -> Any:
    """The tables' statistics stay those the test took, of empty tables: the server's
    autovacuum would analyze them once the batch is in, and the plans would no longer
    be on stale statistics."""
    tables = ("items", "batches", "tenants", "results")
    with db.session_scope() as s:
        for table in tables:
            s.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
    yield
    with db.session_scope() as s:
        for table in tables:
            s.execute(text(f"ALTER TABLE {table} RESET (autovacuum_enabled)"))


def _released_after_empty_statistics(n: int) -> list[Any]:
    # Empty as in a fresh database: no pages left by the tests before (clean_db deletes
    # their rows). ANALYZE of a table of dead pages only records none live in so many
    # pages; the planner then takes every scan to find no row, and between two indexes
    # that both serve a probe only their height differs (the waiting probe then read
    # ix_items_model_status after a test had left 4 900 dead items). Autovacuum's next
    # analyze, 50 rows on, ends that state; a fresh table's does not end so soon.
    with db.session_scope() as s:
        truncate_tables(s)
        s.execute(text("ANALYZE items, batches, tenants, results"))  # all empty
    make_tenant("plans")
    client.submit_batch([chat_line(f"plans-{i}") for i in range(n)], tenant="plans")
    path = Path(get_settings().paths.models_file)
    registry = parse_registry(path.read_text(encoding="utf-8"), str(path))
    with db.session_scope() as s:
        released = release_model(s, registry[MODEL], get_settings())
    assert len(released) >= 32  # a window of the model's
    return released


def _assert_items_found_by_key(plan: dict[str, Any]) -> None:
    on_items = [scan for scan in _scans(plan) if scan["Relation Name"] == "items"]
    assert on_items
    found = {(s["Node Type"], _index_of(s), s.get("Alias")) for s in on_items}
    # The group commit's look for a batch's waiting items (alias w): one probe of its
    # (batch_id, status, line_no) index per batch, the first row only.
    waiting = {(kind, index) for kind, index, alias in found if alias == "w"}
    assert waiting <= {("Index Only Scan", BATCH_INDEX), ("Index Scan", BATCH_INDEX)}, found
    by_key = {(kind, index) for kind, index, alias in found if alias != "w"}
    # Each item by its key: one at a time, or the pack's ids at once (a bitmap of them).
    assert by_key and by_key <= {("Index Scan", "pk_items"), ("Bitmap Heap Scan", "pk_items")}, (
        found
    )


def _index_of(scan: dict[str, Any]) -> str | None:
    """The index a scan reads: its own, or a bitmap heap scan's one bitmap index scan's."""
    if scan["Node Type"] != "Bitmap Heap Scan":
        return scan.get("Index Name")
    below = [p.get("Index Name") for p in scan.get("Plans", ())]
    kinds = [p["Node Type"] for p in scan.get("Plans", ())]
    return below[0] if kinds == ["Bitmap Index Scan"] else None


def test_a_packs_claim_and_group_commit_find_items_by_key_on_stale_statistics(
    clean_db: Any, explained: list[dict[str, Any]]
) -> None:
    pack = _released_after_empty_statistics(2000)[:32]
    with db.autocommit() as connection:
        items.claim_sent_many(
            connection, [(r.ticket, None) for r in pack], 60.0, 0.0, claim_token=1
        )
        answers = [
            {
                **dict.fromkeys(ANSWER_COLUMNS, 0),
                "item_id": r.item_id,
                "attempt": r.ticket.attempt,
                "tenant_id": r.ticket.tenant_id,
                "batch_id": r.ticket.batch_id,
                "model": MODEL,
                "cost_usd": Decimal(0),
                "deployment": MODEL,
                "tier": "standard",
                "response": {"id": "x"},
                "provider_request_id": "x",
            }
            for r in pack
        ]
        items.succeed_answered_many(connection, answers, shard=0)
    assert len(explained) == 2
    for plan in explained:
        _assert_items_found_by_key(plan)


def _plan(name: str, params: dict[str, Any]) -> dict[str, Any]:
    with db.session_scope() as s:
        (found,) = s.execute(text("EXPLAIN (FORMAT JSON) " + source(name)), params).one()
    return found[0]["Plan"] if isinstance(found, list) else json.loads(found)[0]["Plan"]


def _history_of(copies: int) -> None:
    """Each item of the table again ``copies`` times, finished: a history beside the
    batch at work, so that hundreds of its items are few of the table's (a scan of
    the whole table is the better plan for 400 items of 2 000)."""
    names = [c.name for c in Item.__table__.columns if c.name not in ("id", "custom_id", "status")]
    columns = ", ".join(names)
    with db.session_scope() as s:
        s.execute(
            text(
                f"INSERT INTO items (custom_id, status, {columns})"
                f" SELECT custom_id || '.' || g, 'succeeded', {columns}"
                f" FROM items CROSS JOIN generate_series(1, {copies}) AS g"
            )
        )


@pytest.mark.parametrize("n", [32, 400])
def test_holding_and_renewing_leases_find_items_by_key_on_stale_statistics(
    clean_db: Any, n: int
) -> None:
    released = _released_after_empty_statistics(2000)
    _history_of(10)
    ids = sorted(r.item_id for r in released)[:n] + list(range(10**9, 10**9 + n - len(released)))
    params = {"item_ids": ids, "attempts": [0] * len(ids), "lease_s": 60.0}
    for status, never_shorten in (("queued", True), ("running", False)):
        extend = {**params, "status": status, "never_shorten": never_shorten}
        _assert_items_found_by_key(_plan("item_extend_leases", extend))


def test_the_check_sees_a_scan_of_the_queue() -> None:
    """The assertion above fails on a plan that reads items through another index."""
    bitmap = {
        "Node Type": "Bitmap Heap Scan",
        "Relation Name": "items",
        "Plans": [{"Node Type": "Bitmap Index Scan", "Index Name": "ix_items_active_lease"}],
    }
    by_ids = {**bitmap, "Plans": [{"Node Type": "Bitmap Index Scan", "Index Name": "pk_items"}]}
    _assert_items_found_by_key({"Node Type": "ModifyTable", "Plans": [by_ids]})
    by_batch = {"Node Type": "Index Scan", "Relation Name": "items", "Alias": "i"}
    by_batch["Index Name"] = BATCH_INDEX
    for scan in (bitmap, by_batch):
        with pytest.raises(AssertionError):
            _assert_items_found_by_key({"Node Type": "ModifyTable", "Plans": [scan]})
