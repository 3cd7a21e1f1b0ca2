"""Per-tenant usage and cost, from the ledger of billed provider calls.

Totals come from ``tenant_daily_usage`` (kept in the same transaction as each
ledger row, so they equal the ledger to the token), the offline part of them (rows
of the providers' Batch APIs) and what it saved beside them; the part of it that was
waste (duplicate runs, calls cut by a cancel) is read from the ledger rows
marked with a ``waste_reason``. By deployment, everything comes from the totals,
which carry the deployment and the wasted part too (migration 0018).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import Date, case, cast, func, select
from sqlalchemy.orm import Session

from batchgen.errors import ValidationFailed
from batchgen.store.schema import (
    ApiKey,
    Batch,
    Item,
    Result,
    Tenant,
    TenantDailyUsage,
    UsageLedger,
)

GROUPS = ("model", "day", "tenant", "deployment", "key")
MAX_RANGE_DAYS = 366


def parse_range(start: str | None, end: str | None, today: dt.date) -> tuple[dt.date, dt.date]:
    """``from`` / ``to`` as ISO dates (inclusive); default: the last 30 days."""
    try:
        last = dt.date.fromisoformat(end) if end else today
        first = dt.date.fromisoformat(start) if start else last - dt.timedelta(days=29)
    except ValueError as exc:
        raise ValidationFailed(f"from/to must be dates like 2026-11-29: {exc}") from exc
    if first > last:
        raise ValidationFailed("'from' is after 'to'", field="from")
    if (last - first).days >= MAX_RANGE_DAYS:
        raise ValidationFailed(f"a range of at most {MAX_RANGE_DAYS} days", field="from")
    return first, last


def report(
    session: Session,
    first: dt.date,
    last: dt.date,
    group_by: str = "model",
    tenant_id: int | None = None,
) -> list[dict[str, Any]]:
    """Rows of requests, tokens, cost and waste, grouped by ``model``, ``day``, ``tenant``
    or ``deployment`` (each model's deployments apart: from their own totals).

    ``tenant_id=None`` is the admin view over every tenant.
    """
    if group_by not in GROUPS:
        raise ValidationFailed(f"group_by must be one of {', '.join(GROUPS)}", field="group_by")
    if group_by == "deployment":
        return _by_deployment(session, first, last, tenant_id)
    if group_by == "key":
        return _by_key(session, first, last, tenant_id)
    d = TenantDailyUsage
    key = {"model": d.model, "day": d.day, "tenant": Tenant.name}[group_by]
    query = (
        select(
            key.label("key"),
            func.sum(d.requests),
            func.sum(d.prompt_tokens),
            func.sum(d.completion_tokens),
            func.sum(d.cost_usd),
            func.sum(d.offline_requests),
            func.sum(d.offline_prompt_tokens),
            func.sum(d.offline_completion_tokens),
            func.sum(d.offline_cost_usd),
            func.sum(d.saved_usd),
            func.sum(d.cached_tokens),
            func.sum(d.cache_write_tokens),
            func.sum(d.reasoning_tokens),
        )
        .join(Tenant, Tenant.id == d.tenant_id)
        .where(d.day >= first, d.day <= last)
        .group_by(key)
        .order_by(key)
    )
    if tenant_id is not None:
        query = query.where(d.tenant_id == tenant_id)
    rows = {
        r[0]: {
            group_by: r[0].isoformat() if isinstance(r[0], dt.date) else r[0],
            "requests": int(r[1]),
            "prompt_tokens": int(r[2]),
            "completion_tokens": int(r[3]),
            # The kinds of token in them that are billed at their own prices: cached
            # input and cache writes (of prompt_tokens), reasoning (of completion_tokens).
            "cached_tokens": int(r[10]),
            "cache_write_tokens": int(r[11]),
            "reasoning_tokens": int(r[12]),
            "cost_usd": str(r[4]),
            "wasted_requests": 0,
            "wasted_cost_usd": "0",
            # The part bought through the providers' Batch APIs (route offline) and what
            # it saved against the online prices.
            "offline_requests": int(r[5]),
            "offline_prompt_tokens": int(r[6]),
            "offline_completion_tokens": int(r[7]),
            "offline_cost_usd": f"{r[8]:f}",
            "saved_usd": f"{r[9]:f}",
        }
        for r in session.execute(query)
    }
    for k, n, cost in _waste(session, first, last, group_by, tenant_id):
        if k in rows:
            rows[k]["wasted_requests"] = int(n)
            rows[k]["wasted_cost_usd"] = str(cost)
    return list(rows.values())


def _waste(
    session: Session, first: dt.date, last: dt.date, group_by: str, tenant_id: int | None
) -> list[tuple[Any, int, Decimal]]:
    u = UsageLedger
    day = cast(func.timezone("UTC", u.created_at), Date)
    key = {"model": u.model, "day": day, "tenant": Tenant.name}[group_by]
    query = (
        select(key, func.count(), func.sum(u.cost_usd))
        .join(Tenant, Tenant.id == u.tenant_id)
        .where(u.waste_reason.is_not(None), day >= first, day <= last)
        .group_by(key)
    )
    if tenant_id is not None:
        query = query.where(u.tenant_id == tenant_id)
    return [(r[0], r[1], r[2]) for r in session.execute(query)]


def _by_deployment(
    session: Session, first: dt.date, last: dt.date, tenant_id: int | None
) -> list[dict[str, Any]]:
    """The range's totals by model and deployment, from ``tenant_daily_usage``, waste
    included (``deployment`` None: rows of the providers' Batch APIs, and rows from
    before deployments were recorded). A key whose ledger rows all moved to another (an
    estimate whose answer came from another deployment) counts no request: left out,
    as the ledger has none of it."""
    d = TenantDailyUsage
    deployment = func.nullif(d.deployment, "")
    query = (
        select(
            d.model,
            deployment,
            func.sum(d.requests),
            func.sum(d.prompt_tokens),
            func.sum(d.completion_tokens),
            func.sum(d.cached_tokens),
            func.sum(d.cache_write_tokens),
            func.sum(d.reasoning_tokens),
            func.sum(d.cost_usd),
            func.sum(d.wasted_requests),
            _if_any(d.wasted_requests, d.wasted_cost_usd),
            func.sum(d.offline_requests),
            _if_any(d.offline_requests, d.offline_cost_usd),
            func.sum(d.offline_prompt_tokens),
            func.sum(d.offline_completion_tokens),
            _if_any(d.offline_requests, d.saved_usd),
        )
        .where(d.day >= first, d.day <= last)
        .group_by(d.model, deployment)
        .having(func.sum(d.requests) > 0)
        .order_by(d.model, deployment)
    )
    if tenant_id is not None:
        query = query.where(d.tenant_id == tenant_id)
    return [deployment_row(r) for r in session.execute(query)]


def deployment_row(r: Any) -> dict[str, Any]:
    """A row of the usage by deployment, from the sums of a query in this order: model,
    deployment, requests, prompt, completion, cached, cache-write and reasoning tokens,
    cost, wasted requests and cost, offline requests and cost, offline prompt and
    completion tokens, saved."""
    return {
        "model": r[0],
        "deployment": r[1],
        "requests": int(r[2]),
        "prompt_tokens": int(r[3]),
        "completion_tokens": int(r[4]),
        "cached_tokens": int(r[5]),
        "cache_write_tokens": int(r[6]),
        "reasoning_tokens": int(r[7]),
        "cost_usd": str(r[8]),
        "wasted_requests": int(r[9]),
        "wasted_cost_usd": str(r[10]),
        "offline_requests": int(r[11]),
        "offline_prompt_tokens": int(r[13]),
        "offline_completion_tokens": int(r[14]),
        "offline_cost_usd": f"{r[12]:f}",
        "saved_usd": f"{r[15]:f}",
    }


def _by_key(
    session: Session, first: dt.date, last: dt.date, tenant_id: int | None
) -> list[dict[str, Any]]:
    """The range's ledger rows by the API key their batch or call was made with (key
    None: made without one, through the Python API or the CLI, or before keys were
    recorded), waste included and counted apart. Read from the ledger (by its tenant
    and time index), not from the daily totals, which have no key."""
    u = UsageLedger
    day = cast(func.timezone("UTC", u.created_at), Date)
    wasted = u.waste_reason.is_not(None)
    query = (
        select(
            Batch.key_id,
            ApiKey.name,
            ApiKey.key_prefix,
            Tenant.name,
            func.count(),
            func.sum(u.prompt_tokens),
            func.sum(u.completion_tokens),
            func.sum(u.cost_usd),
            func.count().filter(wasted),
            func.coalesce(func.sum(u.cost_usd).filter(wasted), 0),
        )
        .join(Batch, Batch.id == u.batch_id)
        .join(Tenant, Tenant.id == u.tenant_id)
        .outerjoin(ApiKey, ApiKey.id == Batch.key_id)
        .where(day >= first, day <= last)
        .group_by(Batch.key_id, ApiKey.name, ApiKey.key_prefix, Tenant.name)
        .order_by(Tenant.name, Batch.key_id.nulls_first())
    )
    if tenant_id is not None:
        # The index's own bounds, so that only the tenant's range is read.
        start = dt.datetime.combine(first, dt.time(), dt.UTC)
        end = dt.datetime.combine(last + dt.timedelta(days=1), dt.time(), dt.UTC)
        query = query.where(u.tenant_id == tenant_id, u.created_at >= start, u.created_at < end)
    return [
        {
            "key": r[0],
            "key_name": r[1],
            "key_prefix": r[2],
            "tenant": r[3],
            "requests": int(r[4]),
            "prompt_tokens": int(r[5]),
            "completion_tokens": int(r[6]),
            "cost_usd": str(r[7]),
            "wasted_requests": int(r[8]),
            "wasted_cost_usd": str(r[9]),
        }
        for r in session.execute(query)
    ]


def _if_any(requests: Any, usd: Any) -> Any:
    """The sum of ``usd``, or a plain 0 when no request counts in it: the same value
    and scale as the ledger's sum over none of its rows (``0``, not ``0E-10``)."""
    return case((func.sum(requests) > 0, func.sum(usd)), else_=0)


def of_batches(session: Session, batch_ids: list[str]) -> tuple[int, int, Decimal]:
    """Prompt and completion tokens and cost of every billed call of the batches (wasted
    ones included), from their ledger rows."""
    row = session.execute(
        select(
            func.coalesce(func.sum(UsageLedger.prompt_tokens), 0),
            func.coalesce(func.sum(UsageLedger.completion_tokens), 0),
            func.coalesce(func.sum(UsageLedger.cost_usd), 0),
        ).where(UsageLedger.batch_id.in_(batch_ids))
    ).one()
    return int(row[0]), int(row[1]), Decimal(row[2])


@dataclass(frozen=True)
class BatchReport:
    """A batch's items, its results' tokens, cost and end-to-end latency (seconds from
    submit to finish) each, and its offline rows with what they saved."""

    items: int
    results: list[tuple[int, int, Decimal, float]]
    offline_rows: int
    saved_usd: Decimal


def batch_report(session: Session, batch_id: str) -> BatchReport:
    """What the demo prints of one batch."""
    results = session.execute(
        select(
            Result.prompt_tokens,
            Result.completion_tokens,
            Result.cost_usd,
            func.extract("epoch", Item.finished_at - Item.created_at),
        )
        .join(Item, Item.id == Result.item_id)
        .where(Result.batch_id == batch_id)
    )
    total = session.scalar(select(func.count()).where(Item.batch_id == batch_id)) or 0
    offline, saved = session.execute(
        select(func.count(), func.sum(UsageLedger.online_cost_usd - UsageLedger.cost_usd)).where(
            UsageLedger.batch_id == batch_id,
            UsageLedger.route == "offline",
            UsageLedger.waste_reason.is_(None),
        )
    ).one()
    return BatchReport(
        items=int(total),
        results=[(int(p), int(c), usd, float(s)) for p, c, usd, s in results],
        offline_rows=int(offline),
        saved_usd=Decimal(saved or 0),
    )
