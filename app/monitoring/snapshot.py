"""An operator's view of the whole system at a glance (``batchgen status``, ``GET /v1/status``).

Flower shows tasks one by one; this shows per model the backlog, throughput and
budget use, and per tenant the progress of its open batches.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import redis
from sqlalchemy import Date, func, select
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.limits.budget import Budget
from batchgen.limits.concurrency import Slots
from batchgen.registry import Registry
from batchgen.store import provider_jobs, totals
from batchgen.store.schema import Batch, Item, Tenant, TenantDailyUsage

THROUGHPUT_WINDOW_MIN = 5


def snapshot(
    session: Session, client: redis.Redis, registry: Registry, settings: Settings
) -> dict[str, Any]:
    """Per-model and per-tenant state, as plain JSON-ready data, from maintained totals
    (store.totals) in one snapshot: the same cost however long the history."""
    session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    open_now = totals.by(totals.open_counts(session, registry.names), 0)
    counts = {k: c.items for k, c in open_now.items()}
    backlog: dict[str, int] = {}
    for (model, _status), c in open_now.items():
        backlog[str(model)] = backlog.get(str(model), 0) + c.tokens_est
    recent = dict(
        session.execute(
            select(Item.model, func.count())
            .where(
                Item.finished_at.is_not(None),
                Item.finished_at >= func.now() - dt.timedelta(minutes=THROUGHPUT_WINDOW_MIN),
            )
            .group_by(Item.model)
        ).all()
    )
    budget, slots = Budget(client, settings), Slots(client)
    models = []
    for spec in registry:
        used_tokens, used_requests = budget.used(spec)
        models.append(
            {
                "model": spec.name,
                "queue": spec.queue,
                "pending": counts.get((spec.name, "pending"), 0),
                "queued": counts.get((spec.name, "queued"), 0),
                "running": counts.get((spec.name, "running"), 0),
                "offloaded": counts.get((spec.name, "offloaded"), 0),
                "backlog_tokens": int(backlog.get(spec.name) or 0),
                "finished_per_min": recent.get(spec.name, 0) / THROUGHPUT_WINDOW_MIN,
                "inflight": slots.held(spec.name),
                "max_concurrency": spec.max_concurrency,
                "budget_tokens_used": used_tokens,
                "budget_tokens_limit": spec.tokens_per_min,
                "budget_requests_used": used_requests,
                "budget_requests_limit": spec.requests_per_min,
            }
        )
    open_batches = session.execute(
        select(Tenant.name, Batch.id, Batch.status, Batch.total_items)
        .join(Batch, Batch.tenant_id == Tenant.id)
        .where(Batch.finished_at.is_(None))
        .order_by(Tenant.name, Batch.created_at)
    ).all()
    done = totals.batches_finished(session, [b.id for b in open_batches])
    tenants = [
        {
            "tenant": name,
            "batch": batch_id,
            "status": status,
            "total": total,
            "done": sum(done.get(batch_id, {}).values()),
        }
        for name, batch_id, status, total in open_batches
    ]
    return {
        "models": models,
        "open_batches": tenants,
        **offload_view(session),
    }


def offload_view(session: Session) -> dict[str, Any]:
    """Open provider jobs per model, and today's usage by route with what offloading saved."""
    jobs = [
        {"model": j.model, "open": j.count, "items": j.items, "oldest_age_s": j.oldest_age_s}
        for j in provider_jobs.summary(session)
    ]
    d = TenantDailyUsage
    today = func.cast(func.timezone("UTC", func.now()), Date)
    row = session.execute(
        select(
            func.coalesce(func.sum(d.requests), 0),
            func.coalesce(func.sum(d.prompt_tokens + d.completion_tokens), 0),
            func.coalesce(func.sum(d.cost_usd), 0),
            func.coalesce(func.sum(d.offline_requests), 0),
            func.coalesce(func.sum(d.offline_prompt_tokens + d.offline_completion_tokens), 0),
            func.coalesce(func.sum(d.offline_cost_usd), 0),
            func.coalesce(func.sum(d.saved_usd), 0),
        ).where(d.day == today)
    ).one()
    routes = {
        "online": {
            "requests": int(row[0] - row[3]),
            "tokens": int(row[1] - row[4]),
            "cost_usd": f"{row[2] - row[5]:f}",
        },
        "offline": {"requests": int(row[3]), "tokens": int(row[4]), "cost_usd": f"{row[5]:f}"},
    }
    return {"provider_jobs": jobs, "routes_today": routes, "saved_today_usd": f"{row[6]:f}"}
