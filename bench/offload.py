"""The cost of nightly description runs by route: the provider's Batch API, flex calls,
prompt caching and incremental reruns, each beside the online-standard run.

``--scenario offload`` (the first part, below); ``--scenario nightly`` (the second,
run by bench/nightly_costs.py); ``all`` (the default) runs both.

Offloading a nightly description run to the provider's Batch API: cost and time of
the same run online only and with ``offload = auto``, side by side in one run.

Set-up: PostgreSQL and Redis (embedded, or the given ``DATABASE_URL`` / ``REDIS_URL``
in a database of their own), the provider simulator in its own process (online calls
answered in ``--latency-ms``; its Batch API ends a job ``--turnaround-s`` after it is
created, a seeded ``--row-error-rate`` of its rows errored), and two Celery workers ×
16 threads, the first with the beat embedded (as ``batchgen dispatcher`` runs it).

The registry's model declares an offline route at half its online prices (the
providers' Batch API discount), expecting a job within ``--expected-turnaround-s``.
The same nightly job (``--items`` products of a CSV catalog, the shipped
description template, a ``--window`` completion window) is submitted twice through
:func:`batchgen.nightly.runs.submit_job`:

  (a) online only: the job says ``offload = "never"``;
  (b) auto: the job says ``offload = "auto"`` (the default).

For each: the run's cost (the usage ledger, waste included), the time from submit
to the last item finished, the share of items that went offline and the share that
fell back online (a row the provider errored), and whether every item finished
inside its deadline. Target: cost (b) <= 0.55 x cost (a), every item in time.

    .venv/bin/python bench/offload.py [--items 10000] [--turnaround-s 60]

Flex, caching and incremental reruns (``--scenario nightly``): a shop's nightly job
of ``--items`` descriptions with a realistic prompt (bench/nightly_prompt.py: its brand
guidelines, about 1 500 tokens, as the system prompt; a short product template; answers
of 20 to 120 tokens), in a ``--nightly-window`` (1 h: too short for the Batch API's
expected hour plus its fallback). For each ``--provider``: an OpenAI model priced as
gpt-5-mini that offers flex (the simulator answers flex three times slower and
refuses flex calls beyond ``--flex-capacity`` at once, 429 "resource unavailable"),
and an Anthropic model priced as Claude Haiku 4.5 (no flex; its cache only where a
request marks a breakpoint). The simulator's prompt cache keeps a prefix five minutes
after its last use (OpenAI caches a repeated prefix by itself) and starts cold for
each run (a night apart). The simulator's Batch API answers a job's rows as its
online endpoint does, its prompt cache included (the providers' batch discount stacks
with the cache's), ``--turnaround-s`` after the job is made. Runs per provider:

  what a user gets alone, without batchgen (one provider feature each, every product
  called, on the model's twin that keeps no prompt prefix keys unless the feature is
  the breakpoint):
  (1) online standard: ``route = "standard"``, the ``-plain`` twin (the reference);
  (2) Anthropic: a cache breakpoint alone (standard calls with the breakpoint on the
      shared system prompt); OpenAI: flex alone (``route = "flex"``; OpenAI caches a
      repeated prefix by itself), both in the ``--nightly-window``;
  (3) the Batch API alone (``route = "batch"``) in a ``--long-window`` (24 h), with
      the breakpoint on Anthropic (it stacks);
  batchgen, for each window (``--nightly-window`` and ``--long-window``), a job of its own:
  (4) yesterday: the job's first run on yesterday's catalog (its descriptions stored);
  (5) tonight: ``route = "auto"`` and incremental, on tonight's catalog, in which
      ``--unchanged`` products (2 000) are as they were.

Reported: per run, cost, time, reused products, calls by tier, flex refusals, the
share of prompt tokens read from the cache; then, per provider and window, the cost
ratios to (1) of every single feature whose run fits the window, the best of them,
batchgen's total (target <= 0.30x in the 1 h window) and batchgen's per call made
(the route and the cache, without the reuse), which must not exceed the best single
feature's.

    .venv/bin/python bench/offload.py --scenario nightly [--items 10000] [--unchanged 2000]
        [--nightly-window 1h] [--long-window 24h] [--turnaround-s 60]
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import sys
import time
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    MODEL_TOML,
    reset_state,
    servers,
    simulator_process,
    start_celery_worker,
    wait_finished,
)

MODEL = "bench-offload"
WORKERS, THREADS = 2, 16
OFFLINE_TOML = """
[models."{name}".offline]
turnaround_s = {expected}
fallback_s = 300
"""
DAY = dt.date(2026, 12, 1)


def write_catalog(path: Path, n: int) -> Path:
    colors = ["red", "blue", "green", "black", "white", "amber"]
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "name", "color", "material"])
        for i in range(n):
            writer.writerow([f"p{i:05d}", f"Product {i}", colors[i % 6], f"material {i % 17}"])
    return path


def run(job: object, timeout_s: float) -> dict[str, object]:
    from sqlalchemy import func, select

    from batchgen.nightly.runs import submit_job
    from batchgen.store.db import session_scope
    from batchgen.store.schema import Item, UsageLedger

    started = time.monotonic()
    ids, _ = submit_job(job, DAY)  # type: ignore[arg-type]
    wait_finished(ids, timeout_s)
    elapsed_s = time.monotonic() - started
    with session_scope() as s:
        cost = s.scalar(
            select(func.coalesce(func.sum(UsageLedger.cost_usd), 0)).where(
                UsageLedger.batch_id.in_(ids)
            )
        )
        by_status = dict(
            s.execute(
                select(Item.status, func.count())
                .where(Item.batch_id.in_(ids))
                .group_by(Item.status)
            ).all()
        )
        total = sum(by_status.values())
        offline = s.scalar(
            select(func.count())
            .select_from(UsageLedger)
            .where(
                UsageLedger.batch_id.in_(ids),
                UsageLedger.route == "offline",
                UsageLedger.waste_reason.is_(None),
            )
        )
        fell_back = s.scalar(
            select(func.count())
            .select_from(Item)
            .join(UsageLedger, UsageLedger.item_id == Item.id)
            .where(
                Item.batch_id.in_(ids),
                Item.job_id.is_not(None),
                UsageLedger.route == "online",
                UsageLedger.waste_reason.is_(None),
            )
        )
        late = s.scalar(
            select(func.count())
            .select_from(Item)
            .where(Item.batch_id.in_(ids), Item.finished_at > Item.deadline_at)
        )
    return {
        "cost": Decimal(cost),
        "elapsed_s": elapsed_s,
        "total": total,
        "succeeded": by_status.get("succeeded", 0),
        "offline": offline,
        "fell_back": fell_back,
        "late": late,
    }


def run_offload(args: argparse.Namespace) -> None:
    from batchgen.config import get_settings
    from batchgen.nightly.jobs import Job
    from batchgen.store import db, tenants

    sim_args = (
        "--latency-base-ms",
        str(args.latency_ms),
        "--per-token-ms",
        "0",
        "--batch-turnaround-s",
        str(args.turnaround_s),
        "--batch-row-error-rate",
        str(args.row_error_rate),
        "--seed",
        "7",
    )
    with simulator_process(*sim_args) as sim, servers() as workdir:
        models_file = workdir / "models.toml"
        spec = MODEL_TOML.format(
            name=MODEL, base_url=sim, tpm=10_000_000, rpm=1_000_000, concurrency=WORKERS * THREADS
        )
        header = f'[models."{MODEL}"]\n'
        spec = spec.replace(header, header + "offload = true\n")
        models_file.write_text(
            spec + OFFLINE_TOML.format(name=MODEL, expected=args.expected_turnaround_s)
        )
        env = {
            "BATCHGEN_MODELS_FILE": str(models_file),
            "BATCHGEN_SIMULATOR_KEY": "bench",
            "BATCHGEN_OFFLOAD_INTERVAL_S": "1",
            "BATCHGEN_OFFLOAD_POLL_FIRST_S": "5",
            "BATCHGEN_OFFLOAD_POLL_MAX_S": "10",
            "BATCHGEN_DATA_DIR": str(workdir / "data"),
            "DATABASE_URL": os.environ["DATABASE_URL"],
            "REDIS_URL": os.environ.get("REDIS_URL", get_settings().redis.url or ""),
            "CELERY_BROKER_URL": os.environ.get("CELERY_BROKER_URL", get_settings().broker_url),
        }
        os.environ.update(env)
        get_settings.cache_clear()
        catalog = write_catalog(workdir / "catalog.csv", args.items)
        workers = [
            start_celery_worker(
                "batchgen.tasks",
                [f"llm.{MODEL}", "batchgen.control"],
                log_dir=workdir / "logs",
                concurrency=THREADS,
                beat=i == 0,
                env=env,
                name=f"w{i}",
            )
            for i in range(WORKERS)
        ]
        results = {}
        try:
            for w in workers:
                w.wait_ready()
            for label, mode in (("online only", "never"), ("auto", "auto")):
                reset_state(sim)
                with db.session_scope() as s:
                    tenants.create_tenant(s, "shop")
                job = Job(
                    name=f"descriptions-{mode}",
                    tenant="shop",
                    model=MODEL,
                    catalog=catalog,
                    output=workdir / f"out-{mode}.jsonl",
                    completion_window=args.window,
                    offload=mode,
                    max_tokens=200,
                )
                results[label] = run(job, timeout_s=3600)
        finally:
            for w in workers:
                w.stop()

    online, auto = results["online only"], results["auto"]
    print(
        f"{args.items} nightly descriptions, window {args.window}; provider job turnaround "
        f"{args.turnaround_s:g} s, {args.row_error_rate:.0%} of its rows errored; "
        f"online calls {args.latency_ms:g} ms"
    )
    print(
        f"{'':14}{'cost $':>12}{'time s':>10}{'offline':>10}{'fell back':>11}{'late':>6}{'done':>8}"
    )
    for label, r in results.items():
        total = int(r["total"])  # type: ignore[call-overload]
        print(
            f"{label:14}{r['cost']:>12.6f}{r['elapsed_s']:>10.1f}"
            f"{int(r['offline']) / total:>10.1%}{int(r['fell_back']) / total:>11.1%}"  # type: ignore[call-overload]
            f"{r['late']:>6}{r['succeeded']:>8}"
        )
    ratio = Decimal(auto["cost"]) / Decimal(online["cost"])  # type: ignore[arg-type]
    in_time = auto["late"] == 0 and online["late"] == 0
    print(f"cost auto / online only: {ratio:.3f}x (target <= 0.55x), every item in time: {in_time}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", choices=("offload", "nightly", "all"), default="all")
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--turnaround-s", type=float, default=60.0)
    parser.add_argument("--expected-turnaround-s", type=float, default=600.0)
    parser.add_argument("--row-error-rate", type=float, default=0.02)
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--window", default="2h")
    parser.add_argument("--unchanged", type=int, default=2_000)
    parser.add_argument("--nightly-window", default="1h")
    parser.add_argument(
        "--long-window", default="24h", help="nightly: the window that leaves the Batch API room"
    )
    parser.add_argument("--flex-capacity", type=int, default=24)
    parser.add_argument("--provider", choices=("openai", "anthropic", "both"), default="both")
    args = parser.parse_args()
    if args.scenario in ("offload", "all"):
        run_offload(args)
    if args.scenario in ("nightly", "all"):
        from bench.nightly_costs import run_nightly

        run_nightly(args)


if __name__ == "__main__":
    main()
