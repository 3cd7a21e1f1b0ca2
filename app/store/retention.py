"""Retention: batches finished more than ``BATCHGEN_RETENTION_DAYS`` ago are removed
with their items, results, ledger rows, provider jobs and notifications, a few
thousand rows per transaction. The per-tenant daily totals (``tenant_daily_usage``:
requests, tokens, cost, offline part and savings) are kept, so usage and cost
history survive; a removed batch's id then answers 404.

Every row is found by an index, and so is what each foreign key checks when a row it
refers to goes (``sql/retention_*.sql``; tests/integration/test_totals.py checks the
plans on a large history, tests/integration/test_retention.py the indexes), so a pass
costs what it removes, not the size of the history.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from batchgen.store.sqlfiles import query

ITEMS_PER_TRANSACTION = 5000
SECONDS_PER_DAY = 86400


@dataclass
class Purged:
    batches: int = 0
    items: int = 0
    budget_spent: bool = False  # the tick stopped at its time budget, more expired left


def expired_batches(session: Session, retention_days: float, limit: int) -> list[str]:
    """Batches finished before the retention period, oldest first."""
    params = {"retention_s": retention_days * SECONDS_PER_DAY, "limit": limit}
    return list(session.scalars(query("retention_expired_batches"), params))


def purge_items(session: Session, batch_id: str, limit: int = ITEMS_PER_TRANSACTION) -> int:
    """Remove up to ``limit`` of the batch's items with what refers to them; returns how
    many items went (0: none left)."""
    params = {"batch_id": batch_id, "limit": limit}
    return len(session.execute(query("retention_purge_items"), params).all())


def purge_batch_row(session: Session, batch_id: str) -> None:
    """The batch itself, once its items are gone."""
    session.execute(query("retention_purge_batch"), {"batch_id": batch_id})
