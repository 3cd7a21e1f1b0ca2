"""bench/offload.py's second scenario: a nightly job by flex, prompt caching and
incremental reruns beside the online-standard run (see bench/offload.py's docstring)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from dataclasses import dataclass
from decimal import Decimal

import httpx

from bench.harness import servers, simulator_process, start_celery_worker, wait_finished
from bench.nightly_prompt import TEMPLATE, brand_guidelines, write_catalog

WORKERS, THREADS = 2, 16
PART_LINES = 5_000
YESTERDAY, TONIGHT = dt.date(2026, 12, 1), dt.date(2026, 12, 2)
# Both models offer the Batch API (an hour's turnaround expected: too slow for the
# window), each at its provider's prices; the OpenAI one offers flex, the Anthropic one
# caches only where a request marks a breakpoint. Each has a twin that keeps no prompt
# prefix keys (prompt_cache = false), as batchgen ran before: the baseline's.
OPENAI_TOML = """
[models."{name}"]
provider = "openai"
base_url = "{base_url}/v1"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "nightly"
budget_key = "{name}"
context_window = 32768
max_output_tokens = 400
tokens_per_min = 50000000
requests_per_min = 1000000
max_concurrency = {concurrency}
# gpt-5-mini's prices per 1M tokens; flex and batch at half (the registry's default)
input_usd_per_1m = 0.25
cached_input_usd_per_1m = 0.025
output_usd_per_1m = 2.00
max_attempts = 50
offload = true
prompt_cache = {cache}

[models."{name}".offline]
turnaround_s = 3600
fallback_s = 600
max_bytes = 15000000  # the simulator takes a body of at most 16 MiB

[models."{name}".flex]
latency_s = 30
timeout_s = 120
fallback_s = 300
retry_s = 1
retry_max_s = 10
max_refusals = 5
"""
ANTHROPIC_TOML = """
[models."{name}"]
provider = "anthropic"
base_url = "{base_url}"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "nightly"
budget_key = "{name}"
context_window = 200000
max_output_tokens = 400
tokens_per_min = 50000000
requests_per_min = 1000000
max_concurrency = {concurrency}
# Claude Haiku 4.5's prices per 1M tokens; cache reads 0.1x, writes 1.25x (the defaults)
input_usd_per_1m = 1.00
output_usd_per_1m = 5.00
charge_policy = "actual"
max_attempts = 50
offload = true
prompt_cache = {cache}

[models."{name}".offline]
turnaround_s = 3600
fallback_s = 600
max_bytes = 15000000  # the simulator takes a body of at most 16 MiB
"""
PROVIDERS = {
    "openai": (OPENAI_TOML, "gpt-5-mini prices, flex at half"),
    "anthropic": (ANTHROPIC_TOML, "Claude Haiku 4.5 prices, no flex tier"),
}


def registry_text(base_url: str, concurrency: int) -> str:
    """Each provider's model ``nightly-<provider>`` and its twin ``...-plain``."""
    return "".join(
        text.format(
            name=f"nightly-{provider}{suffix}",
            base_url=base_url,
            concurrency=concurrency,
            cache=cache,
        )  # fmt: skip
        for provider, (text, _) in PROVIDERS.items()
        for suffix, cache in (("", "true"), ("-plain", "false"))
    )


@dataclass(frozen=True)
class Night:
    """What one run cost and how it went (from its report and the ledger)."""

    cost: Decimal
    elapsed_s: float
    products: int
    reused: int
    succeeded: int
    late: int
    by_tier: dict[str, int]
    flex_refusals: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def calls(self) -> int:
        return sum(self.by_tier.values())


def _measure(batch_ids: list[str], report: object, elapsed_s: float) -> Night:
    from sqlalchemy import func, select

    from batchgen.store.db import session_scope
    from batchgen.store.schema import Item, UsageLedger

    with session_scope() as s:
        in_run = UsageLedger.batch_id.in_(batch_ids)
        by_tier = dict(
            s.execute(
                select(UsageLedger.tier, func.count())
                .where(in_run, UsageLedger.waste_reason.is_(None))
                .group_by(UsageLedger.tier)
            ).all()
        )
        tokens = s.execute(
            select(
                func.coalesce(func.sum(UsageLedger.prompt_tokens), 0),
                func.coalesce(func.sum(UsageLedger.cached_tokens), 0),
                func.coalesce(func.sum(UsageLedger.completion_tokens), 0),
            ).where(in_run)
        ).one()
        items = Item.batch_id.in_(batch_ids)
        late = s.scalar(select(func.count()).where(items, Item.finished_at > Item.deadline_at))
        refusals = s.scalar(select(func.coalesce(func.sum(Item.flex_refusals), 0)).where(items))
    return Night(
        cost=Decimal(report.cost_usd),  # type: ignore[attr-defined]
        elapsed_s=elapsed_s,
        products=report.products,  # type: ignore[attr-defined]
        reused=report.reused,  # type: ignore[attr-defined]
        succeeded=report.succeeded,  # type: ignore[attr-defined]
        late=int(late or 0),
        by_tier=by_tier,
        flex_refusals=int(refusals or 0),
        prompt_tokens=int(tokens[0]),
        cached_tokens=int(tokens[1]),
        completion_tokens=int(tokens[2]),
    )


def _night(job: object, day: dt.date, timeout_s: float = 3600) -> Night:
    """Submit the job's run for ``day``, wait for its batches, collect it (its output
    written, its descriptions stored for the next run)."""
    from batchgen.nightly.runs import collect_job, submit_job

    started = time.monotonic()
    ids, _ = submit_job(job, day)  # type: ignore[arg-type]
    if ids:
        wait_finished(ids, timeout_s)
    report = collect_job(job, day)  # type: ignore[arg-type]
    while report is None:
        time.sleep(0.5)
        report = collect_job(job, day)  # type: ignore[arg-type]
    return _measure(ids, report, time.monotonic() - started)


def _cold(sim: str) -> None:
    """The simulator's caches, limits and log start afresh (a night later), once the
    last run's calls are done."""
    httpx.post(f"{sim}/_sim/reset").raise_for_status()


def run_nightly(args: argparse.Namespace) -> None:
    from batchgen.config import get_settings
    from batchgen.nightly.jobs import Job
    from batchgen.store import db, tenants

    sim_args = (
        "--latency-ms",
        str(args.latency_ms),
        "--per-token-ms",
        "0",
        "--flex-latency-factor",
        "3",
        "--flex-max-in-flight",
        str(args.flex_capacity),
        "--prompt-cache-ttl-s",
        "300",
        "--batch-turnaround-s",
        str(args.turnaround_s),
        "--seed",
        "7",
    )
    providers = list(PROVIDERS) if args.provider == "both" else [args.provider]
    results: dict[str, dict[str, Night]] = {}
    with simulator_process(*sim_args) as sim, servers() as workdir:
        models_file = workdir / "models.toml"
        models_file.write_text(registry_text(sim, WORKERS * THREADS))
        env = {
            "BATCHGEN_MODELS_FILE": str(models_file),
            "BATCHGEN_SIMULATOR_KEY": "bench",
            "BATCHGEN_DATA_DIR": str(workdir / "data"),
            # 10 000 prompts of 6.6 kB are more text than one submit may hand the
            # tokenizer (BATCHGEN_MAX_TOKENIZE_BYTES, 64 MiB): the job goes in parts.
            "BATCHGEN_MAX_BATCH_LINES": str(PART_LINES),
            # The Batch API's jobs (the simulator ends one --batch-turnaround-s after it
            # is made) are looked at often enough for a bench.
            "BATCHGEN_OFFLOAD_INTERVAL_S": "1",
            "BATCHGEN_OFFLOAD_POLL_FIRST_S": "2",
            "BATCHGEN_OFFLOAD_POLL_MAX_S": "5",
            "DATABASE_URL": os.environ["DATABASE_URL"],
            "REDIS_URL": os.environ.get("REDIS_URL", get_settings().redis.url or ""),
            "CELERY_BROKER_URL": os.environ.get("CELERY_BROKER_URL", get_settings().broker_url),
        }
        os.environ.update(env)
        get_settings.cache_clear()
        template = workdir / "description.j2"
        template.write_text(TEMPLATE)
        system = brand_guidelines()
        catalogs = {
            n: write_catalog(workdir / f"catalog-{n}.csv", args.items, n, args.unchanged)
            for n in (1, 2)
        }

        def job(provider: str, name: str, night: int, model: str = "", **options: object) -> Job:
            options.setdefault("completion_window", args.nightly_window)
            return Job(
                name=f"{name}-{provider}",
                tenant="shop",
                model=f"nightly-{provider}{model}",
                catalog=catalogs[night],
                output=workdir / f"out-{name}-{provider}-{night}.jsonl",
                template=template,
                system=system,
                locale="en-GB",
                max_tokens=200,
                **options,  # type: ignore[arg-type]
            )

        workers = [
            start_celery_worker(
                "batchgen.tasks",
                ["llm.nightly", "batchgen.control"],
                log_dir=workdir / "logs",
                concurrency=THREADS,
                beat=i == 0,
                env=env,
                name=f"w{i}",
            )
            for i in range(WORKERS)
        ]
        try:
            for w in workers:
                w.wait_ready()
            with db.session_scope() as s:
                tenants.create_tenant(s, "shop")
            for provider in providers:
                runs = results[provider] = {}
                long_window = args.long_window
                # What a user gets alone, without batchgen: one provider feature each,
                # every product called (no reuse), on the model as a user would set it.
                alone: list[tuple[str, str, str, dict[str, object]]] = [
                    ("online standard", "-plain", args.nightly_window, {"route": "standard"}),
                ]
                if provider == "anthropic":
                    alone.append(  # a cache breakpoint on the shared system prompt
                        ("breakpoint alone", "", args.nightly_window, {"route": "standard"})
                    )
                else:  # flex (OpenAI caches a repeated prefix by itself)
                    alone.append(("flex alone", "-plain", args.nightly_window, {"route": "flex"}))
                alone.append(  # the Batch API (Anthropic: with the breakpoint, it stacks)
                    (
                        f"batch API alone {long_window}",
                        "" if provider == "anthropic" else "-plain",
                        long_window,
                        {"route": "batch"},
                    )
                )
                for label, model, window, options in alone:
                    _cold(sim)
                    single = job(
                        provider,
                        label.split()[0] + label.split()[1],
                        2,
                        model,
                        incremental=False,
                        completion_window=window,
                        **options,
                    )
                    runs[label] = _night(single, TONIGHT)
                # batchgen: its route (auto) and incremental reruns, each window a job of
                # its own (yesterday's run stores the descriptions tonight's reuses).
                for window in (args.nightly_window, long_window):
                    name = f"descriptions-{window}"
                    _cold(sim)
                    _night(job(provider, name, 1, completion_window=window), YESTERDAY)
                    _cold(sim)
                    tonight = job(provider, name, 2, completion_window=window)
                    runs[f"batchgen {window}"] = _night(tonight, TONIGHT)
        finally:
            for w in workers:
                w.stop()
    load = os.getloadavg()
    for provider, runs in results.items():
        _print(args, system, PROVIDERS[provider][1], runs, load)
    _print_ratios(args, results)


def _print(
    args: argparse.Namespace,
    system: str,
    prices: str,
    runs: dict[str, Night],
    load: tuple[float, float, float],
) -> None:
    from batchgen.domain.formats.tokens import count_text

    standard = runs["online standard"]
    calls = max(1, standard.calls)
    flex = f"; flex answers 3x slower, at most {args.flex_capacity} at once"
    print(
        f"\nnightly job of {args.items} descriptions ({args.unchanged} unchanged since last "
        f"night); prompt: brand guidelines of "
        f"{count_text(system, 'cl100k_base')} tokens as the system prompt + a short product "
        f"template, answers of {standard.completion_tokens / calls:.0f} tokens on average; "
        f"{prices}{flex if 'flex at' in prices else ''}; in batches of {PART_LINES} lines; "
        f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(
        f"{'':22}{'cost $':>11}{'time s':>8}{'reused':>8}{'standard':>9}{'flex':>7}"
        f"{'batch':>7}{'refused':>9}{'cached':>8}{'late':>6}{'done':>7}"
    )
    for label, r in runs.items():
        cached = r.cached_tokens / max(1, r.prompt_tokens)
        print(
            f"{label:22}{r.cost:>11.6f}{r.elapsed_s:>8.1f}{r.reused:>8}"
            f"{r.by_tier.get('standard', 0):>9}{r.by_tier.get('flex', 0):>7}"
            f"{r.by_tier.get('batch', 0):>7}{r.flex_refusals:>9}{cached:>8.1%}{r.late:>6}"
            f"{r.succeeded + r.reused:>7}"
        )


def _window_s(window: str) -> float:
    from batchgen.domain.lifecycle.deadlines import parse_duration_s

    return parse_duration_s(window)


def _print_ratios(args: argparse.Namespace, results: dict[str, dict[str, Night]]) -> None:
    """Cost ratios to the online-standard run, per provider and window: each single
    provider feature whose run fits the window, and batchgen's (its total, and per call
    made: the route and the cache without the reuse). batchgen's route must cost no more
    per call than the best single feature for the same deadline."""
    print(
        f"\n{'cost / online standard':22} {'window':>6}  {'single features that fit':62}"
        f"{'best':>7}{'batchgen':>9}{'per call':>9}{'route <= best':>14}{'in time':>8}"
    )
    for provider, runs in results.items():
        standard = runs["online standard"]
        per_call_standard = standard.cost / max(1, standard.calls)
        for window in (args.nightly_window, args.long_window):
            limit_s = _window_s(window)
            singles = {
                label.replace(f" {args.long_window}", ""): r.cost / standard.cost
                for label, r in runs.items()
                if not label.startswith("batchgen")
                and (not label.endswith(args.long_window) or _window_s(args.long_window) <= limit_s)
            }
            best = min(singles.values())
            ours = runs[f"batchgen {window}"]
            per_call = (ours.cost / max(1, ours.calls)) / per_call_standard
            in_time = ours.late == 0 and ours.succeeded + ours.reused == args.items
            listed = ", ".join(f"{k} {v:.3f}" for k, v in singles.items())
            print(
                f"{provider:22} {window:>6}  {listed:62}{best:>7.3f}"
                f"{ours.cost / standard.cost:>9.3f}{per_call:>9.3f}"
                f"{'yes' if per_call <= best + Decimal('0.005') else 'NO':>14}"
                f"{'yes' if in_time else 'NO':>8}"
            )
