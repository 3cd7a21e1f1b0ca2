"""Prometheus metrics, derived at scrape time from PostgreSQL and Redis.

Every number comes from shared state (the item rows, the ledger, the Redis
budget, slots and counters), so one scrape of any API process is right for
the whole deployment, across processes and hosts, with no multiprocess
mode to set up. Metric names carry units and ``_total`` for counters; no
label ever holds prompt or completion text (only model, queue, tenant name,
status and reason).
"""

from __future__ import annotations

import datetime as dt
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
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.billing import budget_maths as money_rules
from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.limits import counters
from batchgen.limits.budget import Budget
from batchgen.limits.concurrency import Slots
from batchgen.limits.money_budgets import MoneyBudgets
from batchgen.limits.redis_keys import money as money_key
from batchgen.monitoring import runnable
from batchgen.registry import QUEUE_PREFIX, Registry
from batchgen.store import budget_rows as money
from batchgen.store import overview, provider_jobs, totals

TERMINAL_COUNTS = ("succeeded", "failed", "expired", "cancelled")
METRIC_OF = {
    "queue_wait": "batchgen_queue_wait_seconds",
    "upstream": "batchgen_upstream_latency_seconds",
}
HISTOGRAMS = (
    ("queue_wait", "Admission to start of the call that produced the result"),
    ("upstream", "Duration of the provider call that produced the result"),
)


def _histograms(session: Session) -> Iterator[HistogramMetricFamily]:
    """Cumulative histograms per model of the results' queue waits and upstream
    latencies, from the maintained bucket counts (store.totals)."""
    buckets = totals.latency_buckets(session)
    for metric, doc in HISTOGRAMS:
        family = HistogramMetricFamily(METRIC_OF[metric], doc, labels=["model"])
        for (model, kind), rows in sorted(buckets.items()):
            if kind != metric:
                continue
            by_bound = {le_ms: n for le_ms, n, _ in rows}
            cumulative, running = [], 0
            for bound_s, bound_ms in zip(
                totals.LATENCY_BUCKETS_S, totals.LATENCY_BOUNDS_MS, strict=True
            ):
                running += by_bound.get(bound_ms, 0)
                cumulative.append((str(bound_s), running))
            count = sum(n for _, n, _ in rows)
            cumulative.append(("+Inf", count))
            family.add_metric([model], cumulative, sum(ms for _, _, ms in rows) / 1000.0)
        yield family


class StateCollector:
    """A prometheus_client collector reading PostgreSQL and Redis on every scrape.

    The PostgreSQL part reads maintained totals (store.totals) in one snapshot, so a
    scrape costs the same with a million items in the history as with ten."""

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
            # One snapshot for every query of the scrape: the totals and their tail agree.
            session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            finished = totals.finished(session)
            yield from self._models(session, finished)
            yield from self._tenants(session, finished)
            yield from _histograms(session)
            yield from self._runnable(session)
            budgets = money.all_budgets(session)
            names = money.tenant_names(session, {b.tenant_id for b in budgets})
        yield from self._money(budgets, names)
        yield from self._redis()

    def _runnable(self, session: Session) -> Iterator[Metric]:
        """The autoscaling signal per model group (worker queue ``llm.<group>``):
        items that could start now, and the worker slots the group can use
        (batchgen.domain.scheduling.autoscale; docs/operations.md "Kubernetes")."""
        items = GaugeMetricFamily(
            runnable.RUNNABLE_ITEMS,
            "Items that could start now within budget and slots, per model group",
            labels=["group", "queue"],
        )
        wanted = GaugeMetricFamily(
            runnable.SLOTS_WANTED,
            "Worker slots the group's runnable and running calls can use (budget-bound: "
            "no more than its budget keeps busy)",
            labels=["group", "queue"],
        )
        for group, need in runnable.demands(
            session, self.redis, self.registry, self.settings
        ).items():
            items.add_metric([group, QUEUE_PREFIX + group], need.runnable_items)
            wanted.add_metric([group, QUEUE_PREFIX + group], need.worker_slots)
        yield from (items, wanted)

    def _money(self, budgets: list[money.StoredBudget], names: dict[int, str]) -> Iterator[Metric]:
        """Each dollar budget's current period: what is used (settled, at least the
        ledger's spend at its last rebuild), reserved, and its limit, in dollars."""
        labels = ["tenant", "budget", "key", "period"]
        used = GaugeMetricFamily(
            "batchgen_budget_usd_used", "Dollars used in the budget's period", labels=labels
        )
        reserved = GaugeMetricFamily(
            "batchgen_budget_usd_reserved",
            "Dollars reserved for calls in flight in the budget's period",
            labels=labels,
        )
        limit = GaugeMetricFamily(
            "batchgen_budget_usd_limit", "The budget's hard limit per period", labels=labels
        )
        now = dt.datetime.now(dt.UTC)
        levels = MoneyBudgets(self.redis)
        for b in budgets:
            win = money_rules.window(b.rule.period, b.rule.time_zone, now)
            level = levels.level(money_key(b.tenant_id, b.id, win.key))
            key = [
                names.get(b.tenant_id, str(b.tenant_id)),
                str(b.id),
                "" if b.key_id is None else str(b.key_id),
                win.key,
            ]
            used.add_metric(key, (level.used_micros if level else 0) / money_rules.MICROS)
            reserved.add_metric(key, (level.reserved_micros if level else 0) / money_rules.MICROS)
            limit.add_metric(key, b.rule.limit_micros / money_rules.MICROS)
        yield from (used, reserved, limit)

    def _models(self, session: Session, finished: totals.Counts) -> Iterator[Metric]:
        items = GaugeMetricFamily(
            "batchgen_items",
            "Items by model and status (terminal ones: every item that ever ended so, "
            "those removed by retention included)",
            labels=["model", "status"],
        )
        counts = totals.by(finished, 0)
        counts.update(totals.by(totals.open_counts(session, self.registry.names), 0))
        for spec in self.registry:
            for status in ItemStatus:
                count = counts.get((spec.name, status.value), totals.Count())
                items.add_metric([spec.name, status.value], count.items)
        yield items

    def _tenants(self, session: Session, finished: totals.Counts) -> Iterator[Metric]:
        accepted = CounterMetricFamily(
            "batchgen_tenant_items_accepted", "Items admitted per tenant", labels=["tenant"]
        )
        finished_family = CounterMetricFamily(
            "batchgen_tenant_items_finished",
            "Items that reached a terminal state",
            labels=["tenant", "status"],
        )
        names = overview.tenant_names(session)
        admitted = overview.admitted_per_tenant(session)
        for tenant_id, n in sorted(admitted.items(), key=lambda r: names.get(r[0], "")):
            accepted.add_metric([names.get(tenant_id, str(tenant_id))], n)
        for (tenant, status), count in sorted(totals.by(finished, 1).items(), key=str):
            if status in TERMINAL_COUNTS:
                name = names.get(int(tenant), str(tenant))
                finished_family.add_metric([name, status], count.items)
        yield accepted
        yield finished_family

        tokens = CounterMetricFamily(
            "batchgen_tenant_tokens", "Billed tokens per tenant", labels=["tenant", "kind"]
        )
        cost = CounterMetricFamily(
            "batchgen_tenant_cost_usd", "Billed cost per tenant", labels=["tenant"]
        )
        for usage in overview.usage_per_tenant(session):
            tokens.add_metric([usage.tenant, "prompt"], float(usage.prompt_tokens))
            tokens.add_metric([usage.tenant, "completion"], float(usage.completion_tokens))
            cost.add_metric([usage.tenant], float(usage.cost_usd))
        yield tokens
        yield cost
        yield from self._routes(session)

    def _routes(self, session: Session) -> Iterator[Metric]:
        """Usage by route (online, or offline through the providers' Batch APIs), what
        offloading saved, and the open provider jobs."""
        u = overview.usage_by_route(session)
        requests = CounterMetricFamily(
            "batchgen_route_requests", "Billed calls by route", labels=["route"]
        )
        tokens = CounterMetricFamily(
            "batchgen_route_tokens", "Billed tokens by route", labels=["route", "kind"]
        )
        requests.add_metric(["online"], float(u.requests - u.offline_requests))
        requests.add_metric(["offline"], float(u.offline_requests))
        tokens.add_metric(["online", "prompt"], float(u.prompt_tokens - u.offline_prompt_tokens))
        tokens.add_metric(
            ["online", "completion"], float(u.completion_tokens - u.offline_completion_tokens)
        )
        tokens.add_metric(["offline", "prompt"], float(u.offline_prompt_tokens))
        tokens.add_metric(["offline", "completion"], float(u.offline_completion_tokens))
        yield requests
        yield tokens
        saved = CounterMetricFamily(
            "batchgen_offline_saved_usd", "Saved by offloading, against the online prices"
        )
        saved.add_metric([], float(u.saved_usd))
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
