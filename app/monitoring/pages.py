"""The dashboard's data, page by page, as plain values for its templates: the batch
table (a tenant's batches, or every tenant's for an admin key), one batch's page, and
the charts (throughput, tokens against each model's limit, errors over time, cost per
tenant), from the items finished in the last ``CHART_WINDOW_MIN`` minutes and today's
usage totals. Ids, codes and counts only: never request or answer text.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from typing import Any

from sqlalchemy.orm import Session

from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.monitoring import dashboard_display as ui
from batchgen.registry import Registry
from batchgen.store import activity, batches
from batchgen.store.schema import Tenant

CHART_WINDOW_MIN = 30
RATE_WINDOW_MIN = 5
MAX_LINES = 4  # per chart: the largest series, the rest summed as "other"
ERROR_STATUSES = frozenset({ItemStatus.FAILED.value, ItemStatus.EXPIRED.value})


def _when(value: dt.datetime | None) -> str:
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if value else ""


def _row(session: Session, batch: Any, tenant_name: str) -> dict[str, Any]:
    described = batches.describe(session, batch)
    counts = described["request_counts"]
    return {
        "id": batch.id,
        "tenant": tenant_name,
        "tenant_id": batch.tenant_id,
        "status": batch.status,
        "priority": batch.priority,
        "created": _when(batch.created_at),
        "finished_at": _when(batch.finished_at),
        "counts": {s.value: counts[s.value] for s in ItemStatus if counts.get(s.value)},
        "segments": ui.bar_segments(counts),
        "progress": ui.progress(counts),
        "finished": batch.finished_at is not None,
    }


def batch_rows(session: Session, tenant: Tenant | None, limit: int) -> list[dict[str, Any]]:
    """The newest batches the key may see (an admin, or with ``tenant`` None a host's
    operator: every tenant's), with their counts by status, progress and error codes."""
    own = tenant.id if tenant is not None and not tenant.is_admin else None
    listed = activity.recent_batches(session, own, limit)
    rows = [_row(session, batch, name) for batch, name in listed]
    errors = batches.error_codes(session, [r["id"] for r in rows])
    for row in rows:
        row["errors"] = errors.get(row["id"], {})
        # Only a tenant's own may be cancelled (an operator has none: it only reads).
        row["own"] = tenant is not None and row["tenant_id"] == tenant.id
    return rows


def batch_page(session: Session, tenant: Tenant, batch_id: str) -> dict[str, Any]:
    """One batch as its page shows it; NotFound unless the key may read it (its own
    tenant's, or any for an admin key)."""
    batch = batches.get_readable_batch(session, tenant, batch_id)
    row = _row(session, batch, activity.tenant_name(session, batch.tenant_id))
    row["errors"] = batches.error_codes(session, [batch.id]).get(batch.id, {})
    row["own"] = batch.tenant_id == tenant.id
    minutes = activity.per_minute(session, CHART_WINDOW_MIN, batch_id=batch.id)
    recent = sum(m.items for m in minutes if m.minutes_ago < RATE_WINDOW_MIN)
    age_s = (activity.now(session) - batch.created_at).total_seconds()
    rate = ui.rate_per_min(recent, RATE_WINDOW_MIN * 60, age_s)
    left = ui.open_items(row["counts"])
    usage = activity.batch_usage(session, batch.id)
    row.update(
        {
            "rate_per_min": round(rate, 1),
            "rate_window_min": RATE_WINDOW_MIN,
            "open": left,
            "time_left": ui.format_duration_s(ui.time_left_s(left, rate))
            if not row["finished"]
            else "ended",
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cost": ui.format_usd(usage.cost_usd),
            "deadline": _when(batch.deadline_at),
            "throughput": _throughput(minutes),
            "window_min": CHART_WINDOW_MIN,
        }
    )
    return row


def _steps(rows: list[activity.MinuteRow], key: Any, value: Any) -> dict[str, list[float]]:
    """Per series (``key`` of a row), one value per minute of the window, oldest first."""
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * CHART_WINDOW_MIN)
    for r in rows:
        if r.minutes_ago < CHART_WINDOW_MIN:
            series[key(r)][CHART_WINDOW_MIN - 1 - r.minutes_ago] += value(r)
    return _top(dict(series))


def _top(series: dict[str, list[float]]) -> dict[str, list[float]]:
    ranked = sorted(series.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    if len(ranked) <= MAX_LINES:
        return dict(ranked)
    kept = dict(ranked[: MAX_LINES - 1])
    kept["other"] = [sum(v) for v in zip(*(v for _, v in ranked[MAX_LINES - 1 :]), strict=True)]
    return kept


def _x_labels() -> list[str]:
    return [
        f"-{CHART_WINDOW_MIN - 1 - i} min" if i < CHART_WINDOW_MIN - 1 else "now"
        for i in range(CHART_WINDOW_MIN)
    ]


def _throughput(rows: list[activity.MinuteRow]) -> ui.LineChart:
    return ui.line_chart(_steps(rows, lambda r: r.model, lambda r: r.items), x_labels=_x_labels())


def charts(
    session: Session, registry: Registry, tenant: Tenant | None, usage: list[dict[str, Any]]
) -> dict[str, Any]:
    """The charts of the main page: a tenant's own throughput and errors; an admin's
    (or, ``tenant`` None, a host's operator's) over every tenant, with tokens per minute
    against each model's limit and today's cost per tenant (``usage``: today's usage
    rows grouped by tenant)."""
    every_tenant = tenant is None or tenant.is_admin
    rows = activity.per_minute(
        session,
        CHART_WINDOW_MIN,
        tenant_id=None if tenant is None or tenant.is_admin else tenant.id,
    )
    errors = [r for r in rows if r.status in ERROR_STATUSES]
    view: dict[str, Any] = {
        "window_min": CHART_WINDOW_MIN,
        "throughput": _throughput(rows),
        "errors": ui.line_chart(
            _steps(errors, lambda r: r.code or r.status, lambda r: r.items),
            x_labels=_x_labels(),
        ),
        "tokens": [],
        "cost": [],
    }
    if not every_tenant:
        return view
    used = defaultdict(list)
    for r in rows:
        used[r.model].append(r)
    for spec in registry:
        if spec.name not in used:
            continue
        series = _steps(
            used[spec.name], lambda r: "tokens", lambda r: r.prompt_tokens + r.completion_tokens
        )
        view["tokens"].append(
            {
                "model": spec.name,
                "limit": spec.tokens_per_min,
                "chart": ui.line_chart(
                    series,
                    limit=spec.tokens_per_min,
                    limit_label=f"{spec.tokens_per_min:,} tokens/min",
                    x_labels=_x_labels(),
                ),
            }
        )
    view["cost"] = ui.bar_chart(
        [(u["tenant"], float(u["cost_usd"])) for u in usage], label_of=ui.format_usd
    )
    return view
