"""Prometheus metrics, derived at scrape time from PostgreSQL and Redis.

Every number comes from shared state (the item rows, the ledger, the Redis
budget, slots and counters), so one scrape of any API process is right for
the whole deployment, across processes and hosts, with no multiprocess
mode to set up. Metric names carry units and ``_total`` for counters; no
label ever holds prompt or completion text (only model, queue, tenant name,
status and reason).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.status import ItemStatus
from batchgen.limits import counters
from batchgen.limits.budget import Budget
from batchgen.limits.concurrency import Slots
from batchgen.registry import Registry
from batchgen.store import provider_jobs
from batchgen.store.schema import Item, Result, Tenant, TenantDailyUsage

# Seconds; a queue wait or an upstream call of an LLM lies between 10 ms and 10 min.
BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TERMINAL_COUNTS = ("succeeded", "failed", "expired", "cancelled")


def _histogram(session: Session, column: Any, name: str, doc: str) -> HistogramMetricFamily:
    """A cumulative histogram per model of a millisecond column of ``results``."""
    family = HistogramMetricFamily(name, doc, labels=["model"])
    bucket_cols = [
        func.count().filter(column <= int(b * 1000)).label(f"le{i}")
        for i, b in enumerate(BUCKETS_S)
    ]
    query = (
        select(Item.model, *bucket_cols, func.count(), func.coalesce(func.sum(column), 0))
        .join(Item, Item.id == Result.item_id)
        .group_by(Item.model)
    )
    for row in session.execute(query):
        model, *counts, total, sum_ms = row
        buckets = [(str(b), c) for b, c in zip(BUCKETS_S, counts, strict=True)]
        buckets.append(("+Inf", total))
        family.add_metric([model], buckets, float(sum_ms) / 1000.0)
    return family


class StateCollector:
    """A prometheus_client collector reading PostgreSQL and Redis on every scrape."""

    def __init__(
        self,
        session_factory: Any,
        client: redis.Redis,
        registry: Registry,
        settings: Settings,
        broker: redis.Redis | None = None,
    ):
        self.session_factory = session_factory
        self.redis = client
        self.broker = broker  # None when the broker is not Redis (queue lengths unknown)
        self.registry = registry
        self.settings = settings

    def describe(self) -> Iterable[Metric]:
        return []  # collected on demand only

    def collect(self) -> Iterator[Metric]:
        with self.session_factory() as session:
            yield from self._models(session)
            yield from self._tenants(session)
            yield _histogram(
                session,
                Result.queue_wait_ms,
                "batchgen_queue_wait_seconds",
                "Admission to start of the call that produced the result",
            )
            yield _histogram(
                session,
                Result.upstream_latency_ms,
                "batchgen_upstream_latency_seconds",
                "Duration of the provider call that produced the result",
            )
        yield from self._redis()

    def _models(self, session: Session) -> Iterator[Metric]:
        items = GaugeMetricFamily(
            "batchgen_items", "Items by model and status", labels=["model", "status"]
        )
        counts = {
            (m, s): n
            for m, s, n in session.execute(
                select(Item.model, Item.status, func.count()).group_by(Item.model, Item.status)
            )
        }
        for spec in self.registry:
            for status in ItemStatus:
                items.add_metric([spec.name, status.value], counts.get((spec.name, status), 0))
        yield items

    def _tenants(self, session: Session) -> Iterator[Metric]:
        accepted = CounterMetricFamily(
            "batchgen_tenant_items_accepted", "Items admitted per tenant", labels=["tenant"]
        )
        finished = CounterMetricFamily(
            "batchgen_tenant_items_finished",
            "Items that reached a terminal state",
            labels=["tenant", "status"],
        )
        per_status = session.execute(
            select(Tenant.name, Item.status, func.count())
            .join(Item, Item.tenant_id == Tenant.id)
            .group_by(Tenant.name, Item.status)
        ).all()
        totals: dict[str, int] = {}
        for name, status, n in per_status:
            totals[name] = totals.get(name, 0) + n
            if status in TERMINAL_COUNTS:
                finished.add_metric([name, status], n)
        for name, n in totals.items():
            accepted.add_metric([name], n)
        yield accepted
        yield finished

        tokens = CounterMetricFamily(
            "batchgen_tenant_tokens", "Billed tokens per tenant", labels=["tenant", "kind"]
        )
        cost = CounterMetricFamily(
            "batchgen_tenant_cost_usd", "Billed cost per tenant", labels=["tenant"]
        )
        for name, prompt, completion, usd in session.execute(
            select(
                Tenant.name,
                func.sum(TenantDailyUsage.prompt_tokens),
                func.sum(TenantDailyUsage.completion_tokens),
                func.sum(TenantDailyUsage.cost_usd),
            )
            .join(TenantDailyUsage, TenantDailyUsage.tenant_id == Tenant.id)
            .group_by(Tenant.name)
        ):
            tokens.add_metric([name, "prompt"], float(prompt))
            tokens.add_metric([name, "completion"], float(completion))
            cost.add_metric([name], float(usd))
        yield tokens
        yield cost
        yield from self._routes(session)

    def _routes(self, session: Session) -> Iterator[Metric]:
        """Usage by route (online, or offline through the providers' Batch APIs), what
        offloading saved, and the open provider jobs."""
        d = TenantDailyUsage
        row = session.execute(
            select(
                func.coalesce(func.sum(d.requests), 0),
                func.coalesce(func.sum(d.prompt_tokens), 0),
                func.coalesce(func.sum(d.completion_tokens), 0),
                func.coalesce(func.sum(d.offline_requests), 0),
                func.coalesce(func.sum(d.offline_prompt_tokens), 0),
                func.coalesce(func.sum(d.offline_completion_tokens), 0),
                func.coalesce(func.sum(d.saved_usd), 0),
            )
        ).one()
        requests = CounterMetricFamily(
            "batchgen_route_requests", "Billed calls by route", labels=["route"]
        )
        tokens = CounterMetricFamily(
            "batchgen_route_tokens", "Billed tokens by route", labels=["route", "kind"]
        )
        requests.add_metric(["online"], float(row[0] - row[3]))
        requests.add_metric(["offline"], float(row[3]))
        tokens.add_metric(["online", "prompt"], float(row[1] - row[4]))
        tokens.add_metric(["online", "completion"], float(row[2] - row[5]))
        tokens.add_metric(["offline", "prompt"], float(row[4]))
        tokens.add_metric(["offline", "completion"], float(row[5]))
        yield requests
        yield tokens
        saved = CounterMetricFamily(
            "batchgen_offline_saved_usd", "Saved by offloading, against the online prices"
        )
        saved.add_metric([], float(row[6]))
        yield saved
        jobs = GaugeMetricFamily(
            "batchgen_provider_jobs_open",
            "Open jobs at the providers' Batch APIs",
            labels=["model"],
        )
        age = GaugeMetricFamily(
            "batchgen_provider_job_oldest_age_seconds",
            "Age of the oldest open provider job",
            labels=["model"],
        )
        for summary in provider_jobs.summary(session):
            jobs.add_metric([summary.model], summary.count)
            age.add_metric([summary.model], summary.oldest_age_s)
        yield jobs
        yield age

    def _redis(self) -> Iterator[Metric]:
        budget = Budget(self.redis, self.settings)
        slots = Slots(self.redis)
        queue_len = GaugeMetricFamily(
            "batchgen_broker_queue_length",
            "Messages waiting in a model group's queue",
            labels=["queue"],
        )
        inflight = GaugeMetricFamily(
            "batchgen_inflight_calls", "Concurrency slots held", labels=["model"]
        )
        cap = GaugeMetricFamily("batchgen_concurrency_limit", "Concurrency cap", labels=["model"])
        used = GaugeMetricFamily(
            "batchgen_budget_tokens_used", "Tokens reserved in the current window", labels=["model"]
        )
        limit = GaugeMetricFamily(
            "batchgen_budget_tokens_limit", "Tokens allowed per window", labels=["model"]
        )
        events = {
            counters.BUDGET_DENIALS: CounterMetricFamily(
                "batchgen_budget_denials", "Calls that had to wait for budget", labels=["model"]
            ),
            counters.BUDGET_WAIT_S: CounterMetricFamily(
                "batchgen_budget_wait_seconds", "Time spent waiting for budget", labels=["model"]
            ),
            counters.SLOT_DENIALS: CounterMetricFamily(
                "batchgen_concurrency_denials", "Calls that found no free slot", labels=["model"]
            ),
            counters.COOLDOWNS: CounterMetricFamily(
                "batchgen_cooldowns", "Cooldowns started by a provider 429", labels=["model"]
            ),
            counters.RATE_LIMITED: CounterMetricFamily(
                "batchgen_provider_rate_limited", "Provider 429 answers", labels=["model"]
            ),
            counters.TRANSIENT_ERRORS: CounterMetricFamily(
                "batchgen_provider_transient_errors",
                "Provider 5xx, timeouts and resets",
                labels=["model"],
            ),
            counters.PERMANENT_ERRORS: CounterMetricFamily(
                "batchgen_provider_permanent_errors",
                "Provider 4xx other than 429",
                labels=["model"],
            ),
        }
        if self.broker is not None:
            for queue in self.registry.queues:
                queue_len.add_metric([queue], self.broker.llen(queue))
        for spec in self.registry:
            inflight.add_metric([spec.name], slots.held(spec.name))
            cap.add_metric([spec.name], spec.max_concurrency)
            used.add_metric([spec.name], budget.used(spec)[0])
            limit.add_metric([spec.name], spec.tokens_per_min)
            values = counters.read(self.redis, spec.name)
            for field, family in events.items():
                family.add_metric([spec.name], values.get(field, 0.0))
        yield from (queue_len, inflight, cap, used, limit, *events.values())
        rejected = CounterMetricFamily(
            "batchgen_tenant_items_rejected",
            "Batches refused at admission",
            labels=["tenant", "reason"],
        )
        for (tenant, reason), n in counters.read_rejections(self.redis).items():
            rejected.add_metric([tenant, reason], n)
        yield rejected


def render(collector: StateCollector) -> bytes:
    """The text exposition of one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]
    return generate_latest(registry)
