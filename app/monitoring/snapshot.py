"""An operator's view of the whole system at a glance (``batchgen status``, ``GET /v1/status``).

Flower shows tasks one by one; this shows per model the backlog, throughput and
budget use, and per tenant the progress of its open batches.
"""

from __future__ import annotations

from typing import Any

import redis
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.limits.budget import Budget
from batchgen.limits.concurrency import Slots
from batchgen.registry import Registry
from batchgen.store import overview, provider_jobs, totals

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
    recent = overview.finished_per_model_since(session, THROUGHPUT_WINDOW_MIN)
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
    open_batches = overview.open_batches(session)
    done = totals.batches_finished(session, [b.batch_id for b in open_batches])
    tenants = [
        {
            "tenant": b.tenant,
            "batch": b.batch_id,
            "status": b.status,
            "total": b.total_items,
            "done": sum(done.get(b.batch_id, {}).values()),
        }
        for b in open_batches
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
    u = overview.usage_by_route(session, today_only=True)
    offline_tokens = u.offline_prompt_tokens + u.offline_completion_tokens
    routes = {
        "online": {
            "requests": u.requests - u.offline_requests,
            "tokens": u.prompt_tokens + u.completion_tokens - offline_tokens,
            "cost_usd": f"{u.cost_usd - u.offline_cost_usd:f}",
        },
        "offline": {
            "requests": u.offline_requests,
            "tokens": offline_tokens,
            "cost_usd": f"{u.offline_cost_usd:f}",
        },
    }
    return {"provider_jobs": jobs, "routes_today": routes, "saved_today_usd": f"{u.saved_usd:f}"}
