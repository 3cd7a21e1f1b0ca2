"""The latency batchgen adds to a synchronous call, idle and behind a bulk backlog.

Side by side in one run, on embedded PostgreSQL and Redis, a simulator process
(fixed answer time, no limits), a ``batchgen api`` process and real Celery worker
processes, the official ``openai`` SDK makes the same chat completion calls, one
at a time:

1. directly against the simulator (the provider alone);
2. through batchgen's ``POST /v1/chat/completions``, nothing else running (idle);
3. through batchgen while a bulk batch of ``--backlog`` items runs on the same
   model (its queue full, every concurrency slot busy).

Prints p50 / p99 latency of each, batchgen's overhead over the provider alone
(p50 and p99 of idle minus the direct p50 and p99), and the p99 under backlog
over the p99 idle. Targets (issue 13): p99 overhead ≤ 50 ms idle; p99 under
backlog ≤ 2× idle.

    .venv/bin/python bench/interactive.py [--calls 200] [--backlog 5000] [--latency-ms 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    api_process,
    chat_requests,
    live_model_env,
    servers,
    simulator_process,
    start_celery_worker,
)

MODEL = "live"
CONCURRENCY = 16
WORKERS = 2


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _summary(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"p50": _percentile(ms, 0.5), "p99": _percentile(ms, 0.99), "mean": statistics.fmean(ms)}


def _calls(client: Any, model: str, n: int) -> list[float]:
    """``n`` calls one after another; their latencies in seconds (a failure aborts)."""
    out = []
    for i in range(n):
        started = time.perf_counter()
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Describe product {i} in one line."}],
            max_tokens=20,
        )
        out.append(time.perf_counter() - started)
        assert answer.choices[0].message.content
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--backlog", type=int, default=5000)
    parser.add_argument("--latency-ms", type=float, default=200.0)
    args = parser.parse_args()

    import openai

    from batchgen import python_api
    from batchgen.store import db, tenants

    sim_args = ("--latency-base-ms", str(args.latency_ms), "--per-token-ms", "0")
    with simulator_process(*sim_args) as sim, servers() as workdir:
        env = live_model_env(workdir, MODEL, sim, CONCURRENCY)
        with db.session_scope() as s:
            _, key = tenants.create_tenant(s, "caller")
            tenants.create_tenant(s, "bulk")

        direct = openai.OpenAI(base_url=f"{sim}/v1", api_key="bench", max_retries=0)
        _calls(direct, MODEL, 10)  # warm up
        direct_s = _calls(direct, MODEL, args.calls)

        workers = [
            start_celery_worker(
                "batchgen.tasks",
                [f"llm.{MODEL}", "batchgen.control"],
                log_dir=workdir / "logs",
                concurrency=CONCURRENCY,
                beat=i == 0,
                env=env,
                name=f"w{i}",
            )
            for i in range(WORKERS)
        ]
        try:
            for w in workers:
                w.wait_ready()
            with api_process(env, workdir / "api.log") as (api, _):
                ours = openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0)
                _calls(ours, MODEL, 10)
                idle_s = _calls(ours, MODEL, args.calls)

                batch = python_api.submit_batch(
                    chat_requests(args.backlog, MODEL, "bulk"), tenant="bulk", priority="bulk"
                )
                deadline = time.monotonic() + 60
                while (
                    python_api.get_batch(batch["id"], tenant="bulk")["request_counts"]["succeeded"]
                    < 2 * CONCURRENCY
                ):
                    assert time.monotonic() < deadline, "the backlog did not start"
                    time.sleep(0.2)
                backlog_s = _calls(ours, MODEL, args.calls)
                left = python_api.get_batch(batch["id"], tenant="bulk")["request_counts"]
                python_api.cancel_batch(batch["id"], tenant="bulk")
        finally:
            for w in workers:
                w.stop()

    d, i, b = _summary(direct_s), _summary(idle_s), _summary(backlog_s)
    print(f"{args.calls} calls each, one at a time; simulator answers in {args.latency_ms:g} ms")
    print(f"{'':26}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for label, row in (
        ("provider alone", d),
        ("batchgen, idle", i),
        ("batchgen, under backlog", b),
    ):
        print(f"{label:26}{row['p50']:>10.1f}{row['p99']:>10.1f}{row['mean']:>10.1f}")
    pending = left["pending"] + left["queued"] + left["running"]
    print(f"backlog: {args.backlog} bulk items, {pending} still open when the calls ended")
    print(
        f"overhead idle: p50 {i['p50'] - d['p50']:.1f} ms, p99 {i['p99'] - d['p99']:.1f} ms "
        "(target p99 <= 50 ms)"
    )
    print(f"under backlog / idle, p99: {b['p99'] / i['p99']:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
