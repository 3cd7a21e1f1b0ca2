"""Reads the autoscaling signal's inputs (ready items from PostgreSQL; slots held and
the budget's free tokens from Redis; the observed call time from the latency totals)
and asks batchgen.domain.scheduling.autoscale for each model group's demand."""

from __future__ import annotations

from collections import defaultdict

import redis
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.scheduling.autoscale import Demand, ModelLoad, group_demand
from batchgen.limits.budget import Budget
from batchgen.limits.concurrency import Slots
from batchgen.registry import ModelSpec, Registry
from batchgen.store import ready_items as runnable
from batchgen.store import totals

# The gauges (per model group) an autoscaler reads: deploy/helm scales on SLOTS_WANTED.
RUNNABLE_ITEMS = "batchgen_runnable_items"
SLOTS_WANTED = "batchgen_worker_slots_wanted"
UPSTREAM = "upstream"  # the latency totals' metric of a provider call


def call_times_s(session: Session) -> dict[str, float]:
    """Each model's mean provider call time, from the maintained latency totals."""
    found: dict[str, float] = {}
    for (model, metric), rows in totals.latency_buckets(session).items():
        count = sum(n for _, n, _ in rows)
        if metric == UPSTREAM and count:
            found[model] = sum(ms for _, _, ms in rows) / count / 1000.0
    return found


def loads(
    session: Session, client: redis.Redis, registry: Registry, settings: Settings
) -> dict[str, list[ModelLoad]]:
    """Every model's load, by group."""
    # More ready items than max_concurrency change neither gauge (domain.scheduling.autoscale).
    ready = runnable.ready(session, {spec.name: spec.max_concurrency for spec in registry})
    call_s = call_times_s(session)
    budget, slots = Budget(client, settings), Slots(client)
    by_group: dict[str, list[ModelLoad]] = defaultdict(list)
    for spec in registry:
        by_group[spec.group].append(_load(spec, ready.get(spec.name), call_s, budget, slots))
    return by_group


def _load(
    spec: ModelSpec,
    ready: runnable.Ready | None,
    call_s: dict[str, float],
    budget: Budget,
    slots: Slots,
) -> ModelLoad:
    ready = ready or runnable.Ready(0, 0.0)
    used_tokens, _ = budget.used(spec)
    return ModelLoad(
        ready_items=ready.items,
        running_calls=slots.held(spec.name),
        max_concurrency=spec.max_concurrency,
        tokens_per_min=spec.tokens_per_min,
        requests_per_min=spec.requests_per_min,
        tokens_per_item=ready.tokens_per_item,
        budget_free_tokens=float(spec.tokens_per_min - used_tokens),
        call_s=call_s.get(spec.name),
        budget_key=spec.budget_key,
    )


def demands(
    session: Session, client: redis.Redis, registry: Registry, settings: Settings
) -> dict[str, Demand]:
    """Each model group's runnable items and the worker slots they need."""
    return {
        group: group_demand(models)
        for group, models in sorted(loads(session, client, registry, settings).items())
    }
