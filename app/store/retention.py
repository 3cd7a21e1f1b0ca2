"""Retention: batches finished more than ``BATCHGEN_RETENTION_DAYS`` ago are removed
with their items, results, ledger rows, provider jobs and notifications, a few
thousand rows per transaction. The per-tenant daily totals (``tenant_daily_usage``:
requests, tokens, cost, offline part and savings) are kept, so usage and cost
history survive; a removed batch's id then answers 404.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from batchgen.store.schema import (
    Batch,
    BatchNotification,
    Item,
    ProviderJob,
    ProviderJobItem,
    Result,
    UsageLedger,
)

ITEMS_PER_TRANSACTION = 5000


@dataclass
class Purged:
    batches: int = 0
    items: int = 0


def expired_batches(session: Session, retention_days: float, limit: int) -> list[str]:
    """Batches finished before the retention period, oldest first."""
    cutoff = func.now() - dt.timedelta(days=retention_days)
    return list(
        session.scalars(
            select(Batch.id)
            .where(Batch.finished_at.is_not(None), Batch.finished_at < cutoff)
            .order_by(Batch.finished_at)
            .limit(limit)
        )
    )


def purge_items(session: Session, batch_id: str, limit: int = ITEMS_PER_TRANSACTION) -> int:
    """Remove up to ``limit`` of the batch's items with what refers to them; returns how
    many items went (0: none left)."""
    ids = list(session.scalars(select(Item.id).where(Item.batch_id == batch_id).limit(limit)))
    if not ids:
        return 0
    for table in (ProviderJobItem, UsageLedger, Result):
        session.execute(delete(table).where(table.item_id.in_(ids)))
    session.execute(delete(Item).where(Item.id.in_(ids)))
    return len(ids)


def purge_batch_row(session: Session, batch_id: str) -> None:
    """The batch itself, once its items are gone."""
    job_ids = select(ProviderJob.id).where(ProviderJob.batch_id == batch_id)
    session.execute(delete(ProviderJobItem).where(ProviderJobItem.job_id.in_(job_ids)))
    session.execute(delete(ProviderJob).where(ProviderJob.batch_id == batch_id))
    session.execute(delete(BatchNotification).where(BatchNotification.batch_id == batch_id))
    session.execute(delete(UsageLedger).where(UsageLedger.batch_id == batch_id))
    session.execute(delete(Batch).where(Batch.id == batch_id))
