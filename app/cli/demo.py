"""``batchgen demo``: the whole pipeline on one machine, cleaned up afterwards.

Embedded PostgreSQL and Redis (unless URLs are given), migrations, the
provider simulator, one worker process with the dispatcher's beat, three
tenants submitting product-description batches over two models, a live
progress bar and a per-tenant table.
"""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

PRODUCTS = [
    "trail running shoes",
    "espresso grinder",
    "merino wool beanie",
    "LED desk lamp",
    "bamboo cutting board",
    "noise-cancelling headphones",
    "cast iron skillet",
    "yoga mat",
    "stainless water bottle",
    "mechanical keyboard",
]
TONES = ["playful", "premium", "technical", "friendly"]
TENANT_SHARES = (("acme", 0.5), ("globex", 0.33), ("initech", 0.17))


def product_requests(n: int, models: list[str], prefix: str) -> list[dict[str, Any]]:
    """``n`` description requests in the OpenAI Batch input format, alternating models."""
    rows = []
    for i in range(n):
        product = PRODUCTS[i % len(PRODUCTS)]
        rows.append(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": models[i % len(models)],
                    "max_tokens": 120,
                    "messages": [
                        {"role": "system", "content": "You write product descriptions for a shop."},
                        {
                            "role": "user",
                            "content": f"Write a {TONES[i % len(TONES)]} description "
                            f"of product #{i}: {product}.",
                        },
                    ],
                },
            }
        )
    return rows


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def run_demo(
    items: int = 300,
    anthropic: bool = False,
    console: Console | None = None,
    offload: bool = False,
) -> int:
    """Run the demo; returns a process exit code (0 when every item succeeded).

    ``offload``: the models offload, and the tenants' batches are bulk: they go to the
    simulated providers' Batch APIs (a job takes a few seconds) at half the price."""
    console = console or Console()
    if not console.is_terminal:  # a pipe or a CI log: room for the whole table
        console = Console(width=120)
    workdir = Path(tempfile.mkdtemp(prefix="batchgen-demo-"))
    try:
        return _run(items, anthropic, console, workdir, offload)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# The demo's offline route: a job is expected within 30 s; the simulator's take 5 s.
DEMO_OFFLINE = """
[models."{model}".offline]
turnaround_s = 30
fallback_s = 30
"""
DEMO_OFFLOAD_ENV = {
    "BATCHGEN_OFFLOAD_INTERVAL_S": "1",
    "BATCHGEN_OFFLOAD_POLL_FIRST_S": "1",
    "BATCHGEN_OFFLOAD_POLL_MAX_S": "2",
}


def _offload_registry(workdir: Path, models: list[str]) -> dict[str, str]:
    """The shipped registry with ``models`` offloading; the environment that uses it."""
    from batchgen.config import DEFAULT_MODELS_FILE

    text = DEFAULT_MODELS_FILE.read_text()
    for model in models:
        header = f'[models."{model}"]\n'
        text = text.replace(header, header + "offload = true\n") + DEMO_OFFLINE.format(model=model)
    path = workdir / "models.toml"
    path.write_text(text)
    return {"BATCHGEN_MODELS_FILE": str(path), **DEMO_OFFLOAD_ENV}


def _run(items: int, anthropic: bool, console: Console, workdir: Path, offload: bool) -> int:
    from batchgen import embedded, python_api
    from batchgen.config import get_settings
    from batchgen.registry import load_registry
    from batchgen.simulator import SimulatorConfig, SimulatorThread
    from batchgen.store import db, tenants
    from batchgen.worker.procs import start_worker

    started = time.monotonic()
    sim_config = SimulatorConfig(
        latency_base_ms=150, latency_per_token_ms=1.5, latency_jitter_ms=50, seed=7
    )
    sim_config.batch_turnaround_s = 5.0
    models = ["sim-small", "sim-claude" if anthropic else "sim-large"]
    saved_env = dict(os.environ)
    with embedded.services(workdir / "data"), SimulatorThread(sim_config) as sim:
        os.environ["BATCHGEN_SIMULATOR_URL"] = sim.base_url
        if offload:
            os.environ.update(_offload_registry(workdir, models))
        get_settings.cache_clear()
        load_registry.cache_clear()
        console.print(f"[bold]servers[/bold] PostgreSQL + Redis ready, simulator at {sim.base_url}")
        db.upgrade()
        from batchgen.registry import get_registry

        registry = get_registry()
        worker = start_worker(
            registry.queues + ["batchgen.control", "batchgen.notify"],
            log_dir=workdir / "logs",
            concurrency=24,
            beat=True,
            name="demo",
        )
        try:
            worker.wait_ready()
            run_id = secrets.token_hex(3)
            names = [f"{name}-{run_id}" for name, _ in TENANT_SHARES]
            with db.session_scope() as session:
                for name in names:
                    tenants.create_tenant(session, name)
            batch_ids = {}
            remaining = items
            for i, (name, (_, share)) in enumerate(zip(names, TENANT_SHARES, strict=True)):
                n = remaining if i == len(names) - 1 else round(items * share)
                remaining -= n
                batch = python_api.submit_batch(
                    product_requests(n, models, name),
                    tenant=name,
                    priority="bulk" if offload else "interactive",
                )
                batch_ids[name] = batch["id"]
            console.print(
                f"[bold]submitted[/bold] {items} requests for {len(names)} tenants "
                f"over {', '.join(models)}"
            )
            ok = _watch(batch_ids, items, console)
            _report(batch_ids, console)
        finally:
            worker.stop()
            os.environ.clear()
            os.environ.update(saved_env)
            get_settings.cache_clear()
            load_registry.cache_clear()
    console.print(f"wall time {time.monotonic() - started:.1f}s")
    return 0 if ok else 1


def _watch(
    batch_ids: dict[str, str], total: int, console: Console, timeout_s: float = 120.0
) -> bool:
    from batchgen import python_api

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    deadline = time.monotonic() + timeout_s
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("generating", total=total)
        while time.monotonic() < deadline:
            infos = [python_api.get_batch(b, tenant=t) for t, b in batch_ids.items()]
            done = sum(
                i["request_counts"]["total"]
                - i["request_counts"]["pending"]
                - i["request_counts"]["queued"]
                - i["request_counts"]["running"]
                - i["request_counts"]["offloaded"]
                for i in infos
            )
            progress.update(task, completed=done)
            if all(i["finished_at"] is not None for i in infos):
                return all(
                    i["request_counts"]["succeeded"] == i["request_counts"]["total"] for i in infos
                )
            time.sleep(0.25)
    return False


def _report(batch_ids: dict[str, str], console: Console) -> None:
    from batchgen.store import usage
    from batchgen.store.db import session_scope

    table = Table(
        "tenant",
        "requests",
        "succeeded",
        "offline",
        "prompt tok",
        "output tok",
        "cost $",
        "p50 s",
        "p95 s",
        title="per-tenant usage (end-to-end latency)",
    )
    saved_usd = Decimal(0)
    with session_scope() as session:
        for tenant, batch_id in batch_ids.items():
            report = usage.batch_report(session, batch_id)
            rows = report.results
            saved_usd += report.saved_usd
            latencies = sorted(r[3] for r in rows)
            table.add_row(
                tenant,
                str(report.items),
                str(len(rows)),
                str(report.offline_rows),
                str(sum(r[0] for r in rows)),
                str(sum(r[1] for r in rows)),
                f"{sum(r[2] for r in rows):.6f}",
                f"{_pct(latencies, 50):.2f}",
                f"{_pct(latencies, 95):.2f}",
            )
    console.print(table)
    if saved_usd:
        console.print(f"offloaded to the Batch APIs: ${saved_usd:.6f} saved against online prices")
