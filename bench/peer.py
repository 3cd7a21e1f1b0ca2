"""batchgen against a plain asyncio client, and against a token-bucket provider.

Side by side in one run, on embedded PostgreSQL and Redis, a simulator
process on 127.0.0.1 and real Celery worker processes:

A. Throughput with no provider limits and 200 ms answers: batchgen with 2
   worker processes of ``--a-threads`` threads each (32: 64 slots, the model's
   max_concurrency) against one asyncio process calling the same simulator with
   aiohttp and a semaphore of as many slots, the same number of requests
   (``--requests``, 1 500 by default). Prints req/s of each, the fraction of the
   slots' ceiling (slots / answer time) and batchgen's ratio to the asyncio client.
   batchgen's workers first run ``--warmup`` items (64; not measured, the simulator's
   stats reset after them): a worker's connections, scripts and the calls' pace as
   they are after its first calls, not a cold start's (``--warmup 0`` measures
   that too; the asyncio client's session is new either way). ``--pools
   threads,gevent`` runs batchgen's workers on each pool in turn (gevent through
   bench/gevent_worker.py, with the beat in a third, thread-pool process: Celery
   cannot embed it in a gevent worker), to choose the pool by measurement.

B. A provider with token-bucket limits (``--limiter bucket``: capacity
   tokens_per_min / requests_per_min, refilled continuously, and its own token
   count, ceil(body bytes / 4) + max_tokens), batchgen's registry configured
   with exactly the same limits (the registry's *_per_min read per window of
   WINDOW_S seconds via BATCHGEN_BUDGET_WINDOW_S), then 2x too high. Prints
   failed items, the 429 share of provider calls, calls per request, the
   completion time, the fastest finish the provider's limits allow (from the
   simulator's own charges: a full bucket at the start, so
   max(0, (charged - capacity) / refill rate), for tokens and for requests, plus
   the answer time of the last call admitted: --latency-ms)
   and fastest / actual; and whether the provider's bound held.

batchgen's product code is measured as it is; nothing here tunes it.

Against an independent peer provider (``llmock``, a third party's token-bucket mock,
beside the OpenAI cookbook's parallel processor and batchgen's default registry
entry): bench/llmock_peer.py.

    .venv/bin/python bench/peer.py [--requests 1500] [--a-threads 32] [--b-requests 200|2000]
                                   [--pools threads]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    MODEL_TOML,
    chat_requests,
    reset_state,
    servers,
    simulator_process,
    start_celery_worker,
    wait_finished,
)

MODEL = "peer"
WORKERS = 2


def _use_registry(path: Path, env: dict[str, str]) -> None:
    """This process reads the same registry and settings as the workers."""
    from batchgen.config import get_settings

    os.environ.update(env)
    os.environ["BATCHGEN_MODELS_FILE"] = str(path)
    get_settings.cache_clear()


def _completion_s(batch_id: str) -> float:
    """From the batch's submit to its last item's end (database clock)."""
    from sqlalchemy import func, select

    from batchgen.store.db import session_scope
    from batchgen.store.schema import Batch, Item

    with session_scope() as s:
        created = s.scalar(select(Batch.created_at).where(Batch.id == batch_id))
        last = s.scalar(select(func.max(Item.finished_at)).where(Item.batch_id == batch_id))
    assert created is not None and last is not None
    return (last - created).total_seconds()


def run_batchgen(
    label: str,
    n: int,
    concurrency: int,
    models_file: Path,
    env: dict[str, str],
    args: argparse.Namespace,
    sim_url: str,
    workdir: Path,
    pool: str = "threads",
    warmup: int = 0,
) -> dict[str, Any]:
    """One batch of ``n`` items through WORKERS worker processes (Celery's ``pool``);
    provider stats after. ``warmup``: a batch of that many items first, through the same
    workers (not measured; the simulator's stats reset after it)."""
    from batchgen import python_api as client
    from batchgen.api import load_encodings
    from batchgen.store import db, tenants

    reset_state(sim_url)
    _use_registry(models_file, env)
    tenant = f"peer-{label}"
    with db.session_scope() as s:
        tenants.create_tenant(s, tenant)
    worker_env = {**env, "BATCHGEN_MODELS_FILE": str(models_file)}
    workers = [
        start_celery_worker(
            "batchgen.tasks",
            [f"llm.{MODEL}", "batchgen.control"],
            log_dir=workdir / "logs" / label,
            concurrency=concurrency,
            beat=i == 0 and pool == "threads",
            env=worker_env,
            name=f"{label}{i}",
            pool=pool,
        )
        for i in range(WORKERS)
    ]
    if pool != "threads":  # Celery embeds beat only in a thread or prefork worker
        workers.append(
            start_celery_worker(
                "batchgen.tasks",
                ["batchgen.control"],
                log_dir=workdir / "logs" / label,
                concurrency=2,
                beat=True,
                env=worker_env,
                name=f"{label}beat",
            )
        )
    try:
        for w in workers:
            w.wait_ready()
        load_encodings()  # as an API process has at its start, not inside this submit
        if warmup:
            with db.session_scope() as s:
                tenants.create_tenant(s, f"{tenant}-warm")
            warm = client.submit_batch(
                chat_requests(warmup, MODEL, f"{label}-warm", seed=1), tenant=f"{tenant}-warm"
            )
            wait_finished([warm["id"]], timeout_s=args.timeout_s)
            httpx.post(f"{sim_url}/_sim/reset").raise_for_status()
        batch = client.submit_batch(chat_requests(n, MODEL, label), tenant=tenant)
        wait_finished([batch["id"]], timeout_s=args.timeout_s)
    finally:
        for w in workers:
            w.stop()
    elapsed = _completion_s(batch["id"])
    counts = client.get_batch(batch["id"], tenant=tenant)["request_counts"]
    stats = httpx.get(f"{sim_url}/_sim/stats").json()
    log = httpx.get(f"{sim_url}/_sim/log").json()
    first = min((e["start_ts"] for e in log), default=0.0)
    limited_at_s = sorted(e["start_ts"] - first for e in log if e["status"] == 429)
    return {
        "elapsed_s": elapsed,
        "counts": counts,
        "stats": stats,
        "n": n,
        "limited_at_s": limited_at_s,
    }


async def _direct(sim_url: str, n: int, parallel: int) -> tuple[float, list[int]]:
    """``n`` chat calls from one asyncio process, at most ``parallel`` at once."""
    import aiohttp

    bodies = [row["body"] for row in chat_requests(n, MODEL, "direct")]
    gate = asyncio.Semaphore(parallel)
    connector = aiohttp.TCPConnector(limit=parallel)
    timeout = aiohttp.ClientTimeout(total=120)
    headers = {"authorization": "Bearer sk-batchgen-local"}
    async with aiohttp.ClientSession(sim_url, connector=connector, timeout=timeout) as session:

        async def one(body: dict[str, Any]) -> int:
            async with gate, session.post("/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                return r.status

        started = time.monotonic()
        statuses = await asyncio.gather(*(one(b) for b in bodies))
        return time.monotonic() - started, list(statuses)


def part_a(args: argparse.Namespace, workdir: Path) -> None:
    n, conc = args.requests, args.a_threads
    slots = WORKERS * conc
    with simulator_process("--latency-base-ms", str(args.latency_ms)) as sim_url:
        runs: dict[str, dict[str, Any]] = {}
        for pool in args.pools.split(","):
            models_file = workdir / f"models-a-{conc}.toml"
            models_file.write_text(
                MODEL_TOML.format(
                    name=MODEL,
                    base_url=sim_url,
                    tpm=10**9,
                    rpm=10**7,
                    concurrency=slots,  # the slots' ceiling: slots / answer time
                )
            )
            runs[f"batchgen, {WORKERS} x {conc} {pool}"] = run_batchgen(
                f"a{conc}{pool}",
                n,
                conc,
                models_file,
                {"BATCHGEN_LOG_LEVEL": "WARNING"},
                args,
                sim_url,
                workdir,
                pool,
                warmup=args.warmup,
            )
        reset_state(sim_url)
        direct_s, statuses = asyncio.run(_direct(sim_url, n, slots))
        direct_stats = httpx.get(f"{sim_url}/_sim/stats").json()

    direct_rate = n / direct_s
    ceiling = slots / (args.latency_ms / 1000) if args.latency_ms else float("inf")
    print(
        f"\nA. no provider limits, {args.latency_ms:g} ms answers, {n} requests of mixed "
        f"length, {slots} slots (ceiling {ceiling:.0f} req/s); batchgen's workers ran "
        f"{args.warmup} items first (--warmup)"
    )
    print(
        f"{'run':34} {'req/s':>7} {'/ ceiling':>9} {'/ asyncio':>9} {'wall s':>7} {'ok':>5} "
        f"{'failed':>6} {'calls':>6} {'max in flight':>13}"
    )
    for label, r in runs.items():
        rate = n / r["elapsed_s"]
        print(
            f"{label:34} {rate:7.1f} {rate / ceiling:9.3f} {rate / direct_rate:9.3f} "
            f"{r['elapsed_s']:7.2f} {r['counts']['succeeded']:5d} {r['counts']['failed']:6d} "
            f"{r['stats']['requests']:6d} {r['stats']['max_in_flight']:13d}"
        )
    print(
        f"{f'asyncio + aiohttp, semaphore {slots}':34} {direct_rate:7.1f} "
        f"{direct_rate / ceiling:9.3f} {1.0:9.3f} {direct_s:7.2f} "
        f"{statuses.count(200):5d} {n - statuses.count(200):6d} "
        f"{direct_stats['requests']:6d} {direct_stats['max_in_flight']:13d}"
    )


def fastest_finish_s(bound: dict[str, Any], answer_s: float) -> float:
    """The earliest the provider's buckets let its admitted charges through (full at
    start), plus ``answer_s``: the last call admitted still takes its answer time."""
    best = 0.0
    for what in ("tokens", "requests"):
        b = bound[what]
        if b.get("capacity") and b.get("refill_per_s"):
            best = max(best, (b["admitted"] - b["capacity"]) / b["refill_per_s"])
    return max(0.0, best) + answer_s


def part_b(args: argparse.Namespace, workdir: Path) -> None:
    n = args.b_requests
    sim_args = (
        "--limiter",
        "bucket",
        "--tpm",
        str(args.tpm),
        "--rpm",
        str(args.rpm),
        "--window-s",
        str(args.window_s),
        "--latency-base-ms",
        str(args.latency_ms),
    )
    env = {
        "BATCHGEN_LOG_LEVEL": "WARNING",
        "BATCHGEN_BUDGET_WINDOW_S": str(args.window_s),
        # The guard in the same proportion to the window as in production (1 s of 60 s):
        # the window is scaled down here, and a 1 s guard would hold back a tenth of it.
        "BATCHGEN_BUDGET_GUARD_S": str(args.window_s / 60),
    }
    runs: dict[str, dict[str, Any]] = {}
    with simulator_process(*sim_args) as sim_url:
        for factor in (1, 2):
            models_file = workdir / f"models-b-{factor}.toml"
            models_file.write_text(
                MODEL_TOML.format(
                    name=MODEL,
                    base_url=sim_url,
                    tpm=factor * args.tpm,
                    rpm=factor * args.rpm,
                    concurrency=WORKERS * args.b_concurrency,
                )
                # The provider's limiter is a bucket: the registry says so.
                + f'limit_shape = "{args.shape}"\n'
            )
            label = "limits as the provider's" if factor == 1 else "limits 2x too high"
            runs[label] = run_batchgen(
                f"b{factor}", n, args.b_concurrency, models_file, env, args, sim_url, workdir
            )

    print(
        f"\nB. token-bucket provider: {args.tpm} tokens and {args.rpm} requests capacity, "
        f"refilled over {args.window_s:g} s ({args.tpm / args.window_s:g} tokens/s, "
        f"{args.rpm / args.window_s:g} requests/s), own count ceil(bytes/4) + max_tokens; "
        f"{n} requests, {WORKERS} workers x {args.b_concurrency}, {args.latency_ms:g} ms answers"
    )
    print(
        f"{'batchgen registry':26} {'failed':>6} {'calls':>6} {'429 %':>7} {'calls/req':>9} "
        f"{'done s':>7} {'fastest s':>9} {'fastest/done':>12} {'charged tok':>11} "
        f"{'burst<=cap':>10}"
    )
    for label, r in runs.items():
        stats = r["stats"]
        bound = stats["bound"]
        fastest = fastest_finish_s(bound, args.latency_ms / 1000)
        held = bound["tokens"]["respected"] and bound["requests"]["respected"]
        print(
            f"{label:26} {r['counts']['failed']:6d} {stats['requests']:6d} "
            f"{100 * stats['rate_limited'] / max(1, stats['requests']):6.2f}% "
            f"{stats['requests'] / n:9.2f} {r['elapsed_s']:7.2f} {fastest:9.2f} "
            f"{fastest / r['elapsed_s']:12.3f} {bound['tokens']['admitted']:11d} "
            f"{'yes' if held else 'NO':>10}"
        )
    for label, r in runs.items():
        if r["limited_at_s"]:
            when = ", ".join(f"{t:.1f}" for t in r["limited_at_s"])
            print(f"  {label}: 429s at {when} s from the first call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1500, help="part A requests")
    parser.add_argument(
        "--a-threads", type=int, default=32, help="part A threads per worker (slots: 2 x this)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=64,
        help="part A: items batchgen's workers run before the measured batch, not measured "
        "(connections, scripts and the calls' pace, as a worker has them after its first "
        "calls); 0: none",
    )
    parser.add_argument("--b-requests", type=int, default=200, help="part B requests (or 2000)")
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--tpm", type=int, default=20_000, help="part B tokens per window")
    parser.add_argument("--rpm", type=int, default=600, help="part B requests per window")
    parser.add_argument("--window-s", type=float, default=10.0, help="part B window")
    parser.add_argument("--b-concurrency", type=int, default=32, help="part B threads per worker")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--only", choices=("a", "b"), default=None)
    parser.add_argument(
        "--pools",
        default="threads",
        help="part A: Celery pools to run batchgen's workers on, e.g. threads,gevent "
        "(gevent through bench/gevent_worker.py; needs gevent installed)",
    )
    parser.add_argument(
        "--shape",
        choices=("bucket", "window"),
        default="bucket",
        help="part B: the budget shape batchgen's registry declares (the provider is a bucket)",
    )
    args = parser.parse_args()
    for name in ("requests", "a_threads", "b_requests", "tpm", "rpm", "b_concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.warmup <= 10_000:
        parser.error("--warmup must be between 0 and 10000")
    if args.requests > 100_000 or args.b_requests > 100_000:
        parser.error("at most 100000 requests a part")

    with servers() as workdir:
        if args.only in (None, "a"):
            part_a(args, workdir)
        if args.only in (None, "b"):
            part_b(args, workdir)


if __name__ == "__main__":
    main()
