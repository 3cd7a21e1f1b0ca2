"""How much of a provider's token limit the pipeline uses, and how many 429s it gets.

Side by side in one run, against a simulator process enforcing tokens and
requests per window exactly like a provider (sliding window, 429 +
retry-after):

  (a) our pipeline, 4 worker processes, global token budget on
  (b) the same, budget check off (each worker just calls; 429s are retried)

Both limits are per window of WINDOW_S seconds (the registry's *_per_min
fields are read as "per window" via BATCHGEN_BUDGET_WINDOW_S) so a run takes
minutes, not hours. Utilization: the tokens the simulator admitted in the
whole windows from the first admission on ÷ the limit × those windows (the
most any client could have had admitted).

    .venv/bin/python bench/utilization.py [--items 1500] [--window-s 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    MODEL_TOML,
    chat_requests,
    reset_state,
    servers,
    simulator_process,
    wait_finished,
)

MODEL = "bench"


def window_utilization(log: list[dict], tokens_per_window: int, window_s: float) -> float:
    """Admitted tokens ÷ the most the limit allows, over the whole windows from the first
    admission to the last one (windows aligned on the first admission)."""
    admitted = sorted((e["start_ts"], e["charged_tokens"]) for e in log if e["status"] == 200)
    if not admitted:
        return 0.0
    first = admitted[0][0]
    windows = int((admitted[-1][0] - first) // window_s)
    if windows < 1:
        return 0.0
    tokens = sum(t for ts, t in admitted if ts < first + windows * window_s)
    return tokens / (windows * tokens_per_window)


def run(
    label: str,
    budget_on: bool,
    args: argparse.Namespace,
    sim_url: str,
    workdir: Path,
    models_file: Path,
) -> dict[str, float]:
    from batchgen import python_api as client
    from batchgen.store import db, tenants
    from batchgen.worker.procs import start_worker

    reset_state(sim_url)
    env = {
        "BATCHGEN_MODELS_FILE": str(models_file),
        "BATCHGEN_BUDGET_WINDOW_S": str(args.window_s),
        "BATCHGEN_BUDGET_GUARD_S": str(args.guard_s),
        "BATCHGEN_BUDGET_ENABLED": "true" if budget_on else "false",
        "BATCHGEN_MAX_ATTEMPTS": "50",  # without a budget, 429s must not fail items (see also
        # max_attempts in the registry entry)
        "BATCHGEN_LOG_LEVEL": "WARNING",
    }
    with db.session_scope() as s:
        tenants.create_tenant(s, f"bench-{label}")
    batch = client.submit_batch(chat_requests(args.items, MODEL, label), tenant=f"bench-{label}")
    workers = [
        start_worker(
            [f"llm.{MODEL}", "batchgen.control"],
            log_dir=workdir / "logs" / label,
            concurrency=8,
            beat=i == 0,
            env=env,
            name=f"{label}{i}",
        )
        for i in range(4)
    ]
    started = time.monotonic()
    try:
        for w in workers:
            w.wait_ready()
        wait_finished([batch["id"]], timeout_s=args.timeout_s)
    finally:
        for w in workers:
            w.stop()
    elapsed = time.monotonic() - started
    stats = httpx.get(f"{sim_url}/_sim/stats").json()
    log = httpx.get(f"{sim_url}/_sim/log", params={"limit": 1_000_000}).json()
    counts = client.get_batch(batch["id"], tenant=f"bench-{label}")["request_counts"]
    return {
        "utilization": window_utilization(log, args.tpm, args.window_s),
        "calls": stats["requests"],
        "429s": stats["rate_limited"],
        "429_share": stats["rate_limited"] / max(1, stats["requests"]),
        "succeeded": counts["succeeded"],
        "failed": counts["failed"],
        "elapsed_s": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=1500)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--guard-s", type=float, default=0.4)
    parser.add_argument("--tpm", type=int, default=30_000, help="tokens per window")
    parser.add_argument("--rpm", type=int, default=5_000, help="requests per window")
    parser.add_argument("--timeout-s", type=float, default=900)
    args = parser.parse_args()

    with (
        servers() as workdir,
        simulator_process(
            "--tpm",
            str(args.tpm),
            "--rpm",
            str(args.rpm),
            "--window-s",
            str(args.window_s),
            "--latency-ms",
            "60",
            "--per-token-ms",
            "0.3",
            "--charge-mode",
            "reserve",
        ) as sim_url,
    ):
        models_file = workdir / "models.toml"
        models_file.write_text(
            MODEL_TOML.format(
                name=MODEL, base_url=sim_url, tpm=args.tpm, rpm=args.rpm, concurrency=16
            )
        )
        os.environ["BATCHGEN_MODELS_FILE"] = str(models_file)
        from batchgen.config import get_settings

        get_settings.cache_clear()
        results = {
            "(a) budget on, 4 workers": run("on", True, args, sim_url, workdir, models_file),
            "(b) budget off, 4 workers": run("off", False, args, sim_url, workdir, models_file),
        }
    print(
        f"\nlimit: {args.tpm} tokens and {args.rpm} requests per {args.window_s:g} s window; "
        f"{args.items} items of mixed length; guard {args.guard_s:g} s"
    )
    print(
        f"{'run':28} {'tokens/limit':>12} {'calls':>6} {'429s':>6} {'429 %':>7} "
        f"{'ok':>5} {'failed':>6} {'wall s':>7}"
    )
    for label, r in results.items():
        print(
            f"{label:28} {r['utilization']:12.3f} {r['calls']:6d} {r['429s']:6d} "
            f"{100 * r['429_share']:6.2f}% {r['succeeded']:5d} {r['failed']:6d} "
            f"{r['elapsed_s']:7.1f}"
        )


if __name__ == "__main__":
    main()
