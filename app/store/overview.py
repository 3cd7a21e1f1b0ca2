"""What the operator's views read besides the totals (``GET /metrics``, ``batchgen
status``, ``GET /v1/status``): tenants' names, items admitted and usage per tenant,
usage by route, the items finished lately and the open batches. Each reads small
maintained tables (``admitted_totals``, ``tenant_daily_usage``) or an index, so it
costs the same however long the history.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import Date, func, select
from sqlalchemy.orm import Session

from batchgen.store.schema import AdmittedTotals, Batch, Item, Tenant, TenantDailyUsage


def tenant_names(session: Session) -> dict[int, str]:
    """Every tenant's name by id."""
    return {i: n for i, n in session.execute(select(Tenant.id, Tenant.name))}


def admitted_per_tenant(session: Session) -> dict[int, int]:
    """Items ever admitted, per tenant id."""
    rows = session.execute(
        select(AdmittedTotals.tenant_id, func.sum(AdmittedTotals.items)).group_by(
            AdmittedTotals.tenant_id
        )
    )
    return {tenant_id: int(n) for tenant_id, n in rows}


@dataclass(frozen=True)
class TenantUsage:
    tenant: str
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal


def usage_per_tenant(session: Session) -> list[TenantUsage]:
    """Billed tokens and cost per tenant (by name), from the daily totals."""
    d = TenantDailyUsage
    rows = session.execute(
        select(
            Tenant.name,
            func.sum(d.prompt_tokens),
            func.sum(d.completion_tokens),
            func.sum(d.cost_usd),
        )
        .join(d, d.tenant_id == Tenant.id)
        .group_by(Tenant.name)
    )
    return [TenantUsage(name, int(p), int(c), usd) for name, p, c, usd in rows]


@dataclass(frozen=True)
class RouteUsage:
    """Billed calls, tokens and cost in all, and the offline part of them (through the
    providers' Batch APIs) with what it saved against the online prices."""

    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal
    offline_requests: int
    offline_prompt_tokens: int
    offline_completion_tokens: int
    offline_cost_usd: Decimal
    saved_usd: Decimal


def usage_by_route(session: Session, *, today_only: bool = False) -> RouteUsage:
    """The daily totals summed over every tenant and model: all days, or today's (UTC)."""
    d = TenantDailyUsage
    columns = (
        d.requests,
        d.prompt_tokens,
        d.completion_tokens,
        d.cost_usd,
        d.offline_requests,
        d.offline_prompt_tokens,
        d.offline_completion_tokens,
        d.offline_cost_usd,
        d.saved_usd,
    )
    query = select(*(func.coalesce(func.sum(c), 0) for c in columns))
    if today_only:
        query = query.where(d.day == func.cast(func.timezone("UTC", func.now()), Date))
    row: Any = session.execute(query).one()
    return RouteUsage(
        int(row[0]),
        int(row[1]),
        int(row[2]),
        Decimal(row[3]),
        int(row[4]),
        int(row[5]),
        int(row[6]),
        Decimal(row[7]),
        Decimal(row[8]),
    )


def finished_per_model_since(session: Session, minutes: float) -> dict[str, int]:
    """Items finished in the last ``minutes``, per model (``ix_items_finished_at``)."""
    rows = session.execute(
        select(Item.model, func.count())
        .where(
            Item.finished_at.is_not(None),
            Item.finished_at >= func.now() - dt.timedelta(minutes=minutes),
        )
        .group_by(Item.model)
    )
    return {model: int(n) for model, n in rows}


@dataclass(frozen=True)
class OpenBatch:
    tenant: str
    batch_id: str
    status: str
    total_items: int


def open_batches(session: Session) -> list[OpenBatch]:
    """The batches not finished yet, by tenant name then age (``ix_batches_unfinished``)."""
    rows = session.execute(
        select(Tenant.name, Batch.id, Batch.status, Batch.total_items)
        .join(Batch, Batch.tenant_id == Tenant.id)
        .where(Batch.finished_at.is_(None))
        .order_by(Tenant.name, Batch.created_at)
    )
    return [OpenBatch(*row) for row in rows]
