"""Operator commands: ``batchgen usage`` and ``batchgen status``."""

from __future__ import annotations

import datetime as dt
from typing import Any

import typer
from rich.table import Table

from batchgen.cli.common import console, err, handled, print_json, services

JSON = typer.Option(False, "--json", help="Print one JSON document for scripts.")


def _iso_day(value: str | None) -> str | None:
    """A ``YYYY-MM-DD`` option, checked before anything runs (wrong usage: exit 2)."""
    if value is not None:
        try:
            dt.date.fromisoformat(value)
        except ValueError as exc:
            raise typer.BadParameter(f"{value!r} is not a date (YYYY-MM-DD)") from exc
    return value


def usage(
    tenant: str = typer.Option(None, help="One tenant; default: every tenant (admin view)."),
    start: str = typer.Option(
        None, "--from", callback=_iso_day, help="First day, YYYY-MM-DD (default: 30 days ago)."
    ),
    end: str = typer.Option(
        None, "--to", callback=_iso_day, help="Last day, YYYY-MM-DD (default: today)."
    ),
    group_by: str = typer.Option(
        "model", help="model, day, deployment, key, or tenant (all tenants only)."
    ),
    as_json: bool = JSON,
) -> None:
    """Requests, tokens, cost and waste from the usage ledger."""
    from batchgen import python_api

    with services(), handled(as_json):
        rows = python_api.usage(tenant=tenant, start=start, end=end, group_by=group_by)
    if as_json:
        print_json(rows)
        return
    table = Table(
        group_by,
        "requests",
        "prompt tokens",
        "output tokens",
        "cost $",
        "wasted calls",
        "wasted $",
        "offline calls",
        "saved $",
        title="usage",
    )
    for r in rows:
        table.add_row(
            _usage_label(group_by, r),
            str(r["requests"]),
            str(r["prompt_tokens"]),
            str(r["completion_tokens"]),
            r["cost_usd"],
            str(r["wasted_requests"]),
            r["wasted_cost_usd"],
            str(r.get("offline_requests", "")),  # the usage by key has no offline part
            r.get("saved_usd", ""),
        )
    console.print(table)


def _usage_label(group_by: str, row: dict[str, Any]) -> str:
    if group_by == "deployment":
        return f"{row['model']}@{row['deployment']}"
    if group_by == "key":
        if row["key"] is None:
            return f"{row['tenant']}/(no key)"
        return f"{row['tenant']}/{row['key']} {row['key_name']} ({row['key_prefix']}…)"
    return str(row[group_by])


def status(as_json: bool = JSON) -> None:
    """Per-model backlog, throughput and budget use, and per-tenant progress."""
    from batchgen.config import get_settings
    from batchgen.limits.backend import get_redis
    from batchgen.monitoring.queues import queue_view
    from batchgen.monitoring.snapshot import snapshot
    from batchgen.registry import get_registry
    from batchgen.store.db import session_scope

    with services(), handled(as_json), session_scope() as session:
        data = snapshot(session, get_redis(), get_registry(), get_settings())
        data.update(queue_view(get_registry(), get_settings(), get_redis()))
    if as_json:
        print_json(data)
        return
    models = Table(
        "model",
        "pending",
        "queued",
        "running",
        "offloaded",
        "backlog tok",
        "done/min",
        "slots",
        "budget tok",
        title="models",
    )
    for m in data["models"]:
        models.add_row(
            m["model"],
            str(m["pending"]),
            str(m["queued"]),
            str(m["running"]),
            str(m["offloaded"]),
            str(m["backlog_tokens"]),
            f"{m['finished_per_min']:.1f}",
            f"{m['inflight']}/{m['max_concurrency']}",
            f"{m['budget_tokens_used']}/{m['budget_tokens_limit']}",
        )
    console.print(models)
    if data["provider_jobs"] or data["routes_today"]["offline"]["requests"]:
        jobs = Table(
            "model", "open jobs", "items", "oldest (s)", title="provider jobs (Batch APIs)"
        )
        for j in data["provider_jobs"]:
            jobs.add_row(j["model"], str(j["open"]), str(j["items"]), f"{j['oldest_age_s']:.0f}")
        console.print(jobs)
        routes = Table("route", "requests", "tokens", "cost $", title="today by route")
        for route, r in data["routes_today"].items():
            routes.add_row(route, str(r["requests"]), str(r["tokens"]), r["cost_usd"])
        console.print(routes)
        console.print(f"saved today against the online price: ${data['saved_today_usd']}")
    queues = Table("queue", "messages", "workers", title="queues")
    for q in data["queues"]:
        messages = "?" if q["messages"] is None else str(q["messages"])
        queues.add_row(q["queue"], messages, ", ".join(q["workers"]) or "-")
    console.print(queues)
    for warning in data["warnings"]:
        err.print(f"[bold yellow]warning:[/bold yellow] {warning}")
    batches = Table("tenant", "batch", "status", "done", "total", title="open batches")
    for b in data["open_batches"]:
        batches.add_row(b["tenant"], b["batch"], b["status"], str(b["done"]), str(b["total"]))
    console.print(batches)


def doctor(as_json: bool = JSON) -> None:
    """Check the configuration, database (migrated?), Redis, broker, a worker on every
    queue and every provider endpoint; say what to do about each problem (exit 1)."""
    from batchgen.config import get_settings
    from batchgen.monitoring.doctor import run_checks
    from batchgen.registry import load_registry

    with services(), handled(as_json):
        settings = get_settings()
        checks = run_checks(settings, lambda: load_registry(settings.paths.models_file))
    if as_json:
        print_json([c.as_dict() for c in checks])
    else:
        table = Table("check", "", "found", "what to do", title="batchgen doctor")
        for c in checks:
            table.add_row(c.name, "ok" if c.ok else "[red]FAIL[/red]", c.found, c.fix or "")
        console.print(table)
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


def register(cli: typer.Typer) -> None:
    for command in (usage, status, doctor):
        cli.command()(command)
