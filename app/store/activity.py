"""What the dashboard reads besides the batch objects: the recent batches of a tenant
or of all of them, the items finished per minute lately (through
``ix_items_finished_at``: the cost is the last hour's items, not the history), and a
batch's tokens and cost from its results.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Integer, cast, extract, func, select
from sqlalchemy.orm import Session

from batchgen.store.schema import Batch, Item, Result, Tenant, listed_batch


def recent_batches(session: Session, tenant_id: int | None, limit: int) -> list[tuple[Batch, str]]:
    """The newest batches with their tenant's name: one tenant's, or every tenant's
    (``tenant_id=None``, an admin's view). Synchronous calls are not listed."""
    query = (
        select(Batch, Tenant.name)
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(listed_batch())
        .order_by(Batch.created_at.desc(), Batch.id.desc())
        .limit(limit)
    )
    if tenant_id is not None:
        query = query.where(Batch.tenant_id == tenant_id)
    return [(batch, name) for batch, name in session.execute(query)]


def now(session: Session) -> dt.datetime:
    """The database's clock (the one ``finished_at`` is written by)."""
    value = session.scalar(select(func.now()))
    assert value is not None
    return value


def tenant_name(session: Session, tenant_id: int) -> str:
    """The tenant's name."""
    return str(session.scalar(select(Tenant.name).where(Tenant.id == tenant_id)))


@dataclass(frozen=True)
class MinuteRow:
    """Items that ended in one minute (``minutes_ago`` 0: the current one)."""

    minutes_ago: int
    model: str
    status: str
    code: str | None  # the error code of a failed or expired item
    items: int
    prompt_tokens: int
    completion_tokens: int


def per_minute(
    session: Session,
    window_min: int,
    *,
    tenant_id: int | None = None,
    batch_id: str | None = None,
) -> list[MinuteRow]:
    """Items finished in the last ``window_min`` minutes, per minute, model, status and
    error code, with the tokens their results used; of one tenant or batch, or all."""
    since = func.now() - dt.timedelta(minutes=window_min)
    ago = cast(func.floor(extract("epoch", func.now() - Item.finished_at) / 60), Integer)
    query = (
        select(
            ago.label("ago"),
            Item.model,
            Item.status,
            Item.error_code,
            func.count(),
            func.coalesce(func.sum(Result.prompt_tokens), 0),
            func.coalesce(func.sum(Result.completion_tokens), 0),
        )
        .outerjoin(Result, Result.item_id == Item.id)
        .where(Item.finished_at.is_not(None), Item.finished_at >= since)
        .group_by(ago, Item.model, Item.status, Item.error_code)
    )
    if tenant_id is not None:
        query = query.where(Item.tenant_id == tenant_id)
    if batch_id is not None:
        query = query.where(Item.batch_id == batch_id)
    return [
        MinuteRow(max(int(r[0]), 0), r[1], r[2], r[3], int(r[4]), int(r[5]), int(r[6]))
        for r in session.execute(query)
    ]


@dataclass(frozen=True)
class BatchUsage:
    results: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal


def batch_usage(session: Session, batch_id: str) -> BatchUsage:
    """Tokens and cost of a batch's results (the calls of record; waste is in the
    tenant's usage report)."""
    row = session.execute(
        select(
            func.count(),
            func.coalesce(func.sum(Result.prompt_tokens), 0),
            func.coalesce(func.sum(Result.completion_tokens), 0),
            func.coalesce(func.sum(Result.cost_usd), 0),
        ).where(Result.batch_id == batch_id)
    ).one()
    return BatchUsage(int(row[0]), int(row[1]), int(row[2]), Decimal(row[3]))
