"""The latency batchgen adds to a synchronous call, idle and behind a bulk backlog.

Side by side in one run, on embedded PostgreSQL and Redis, a simulator process
(fixed time to the first token, then a fixed time per token; no limits), a
``batchgen api`` process and real Celery worker processes, the official ``openai``
SDK makes the same chat completion calls, one at a time, whole and streamed:

1. directly against the simulator (the provider alone);
2. through batchgen's ``POST /v1/chat/completions``, nothing else running (idle);
3. through batchgen while a bulk batch of ``--backlog`` items runs on the same
   model (its queue full, every concurrency slot busy).

Prints p50 / p99 of each: a whole call's latency, and a streamed call's time to its
first chunk (the SDK's first chunk in the caller's hands); then batchgen's overhead
over the provider alone, and the p99 under backlog over the p99 idle. Targets:
whole calls (issue 13) p99 overhead <= 50 ms idle, p99 under backlog <= 2x idle;
streams (issue 28) first chunk within 50 ms of the provider's at p50.

It also prints the backlog's throughput and the slots it held, sampled every 0.1 s,
for ``--bulk-window-s`` with no calls (once the calls' mark has lapsed: the reserve
of slots for calls is lent to bulk work) and while the calls of phase 3 run. The
processes run with ``BATCHGEN_CALL_RESERVE_RECENT_S=--recent-s`` (5 s rather than
30), so that the wait for the mark to lapse costs little of the backlog.

    .venv/bin/python bench/interactive.py [--calls 200] [--backlog 5000] [--latency-ms 200]
        [--per-token-ms 5] [--bulk-window-s 10] [--recent-s 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict
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


def _streams(client: Any, model: str, n: int) -> list[float]:
    """``n`` streamed calls one after another; the time to each one's first chunk in
    seconds (each stream is read to its end before the next call)."""
    out = []
    for i in range(n):
        started = time.perf_counter()
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Describe item {i} in one line."}],
            max_tokens=20,
            stream=True,
        )
        chunks = iter(stream)
        next(chunks)
        out.append(time.perf_counter() - started)
        assert sum(1 for _ in chunks) > 1
    return out


class SlotSampler(threading.Thread):
    """Samples the model's slots every 0.1 s: those held by bulk work and by calls,
    under the label of the phase under way (None: not sampled)."""

    def __init__(self, redis: Any, model: str) -> None:
        super().__init__(daemon=True)
        self.redis, self.model = redis, model
        self.phase: str | None = None
        self.samples: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.done = threading.Event()

    def run(self) -> None:
        from batchgen.limits import redis_keys as keys

        while not self.done.wait(0.1):
            phase = self.phase
            if phase is None:
                continue
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrangebyscore(keys.slots(self.model), time.time(), "+inf")
            pipe.hgetall(keys.slot_tenants(self.model))
            holders, tenants = pipe.execute()
            calls = sum(1 for h in holders if tenants.get(h, b"").endswith(b":call"))
            self.samples[phase].append((len(holders) - calls, calls))

    def mean(self, phase: str) -> tuple[float, float]:
        """Mean slots held (bulk, calls) in ``phase``."""
        taken = self.samples[phase] or [(0, 0)]
        return statistics.fmean(b for b, _ in taken), statistics.fmean(c for _, c in taken)


def _succeeded(batch_id: str) -> int:
    from batchgen import python_api

    counts = python_api.get_batch(batch_id, tenant="bulk")["request_counts"]
    return int(counts["succeeded"])


def _both(client: Any, n: int) -> tuple[list[float], list[float]]:
    """Whole calls and streamed ones, in turn, ``n`` of each."""
    whole: list[float] = []
    first: list[float] = []
    for _ in range(n // 10):
        whole += _calls(client, MODEL, 10)
        first += _streams(client, MODEL, 10)
    return whole, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--backlog", type=int, default=5000)
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--per-token-ms", type=float, default=5.0)
    parser.add_argument("--bulk-window-s", type=float, default=10.0)
    parser.add_argument("--recent-s", type=float, default=5.0)
    args = parser.parse_args()

    import openai

    from batchgen import python_api
    from batchgen.config import get_settings
    from batchgen.limits import redis_keys as keys
    from batchgen.limits.backend import get_redis
    from batchgen.store import db, tenants

    sim_args = ("--latency-base-ms", str(args.latency_ms), "--per-token-ms", str(args.per_token_ms))
    with simulator_process(*sim_args) as sim, servers() as workdir:
        recent = {"BATCHGEN_CALL_RESERVE_RECENT_S": str(args.recent_s)}
        env = live_model_env(workdir, MODEL, sim, CONCURRENCY, **recent)
        reserved = get_settings().calls.reserved_slots
        sampler = SlotSampler(get_redis(), MODEL)
        sampler.start()
        with db.session_scope() as s:
            _, key = tenants.create_tenant(s, "caller")
            tenants.create_tenant(s, "bulk")

        direct = openai.OpenAI(base_url=f"{sim}/v1", api_key="bench", max_retries=0)
        _both(direct, 10)  # warm up
        direct_s, direct_first_s = _both(direct, args.calls)

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
                _both(ours, 10)
                idle_s, idle_first_s = _both(ours, args.calls)

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
                # Bulk alone, once the idle phase's calls no longer count as recent.
                while get_redis().exists(keys.calls_seen(MODEL)):
                    time.sleep(0.1)
                sampler.phase, started, before = "alone", time.monotonic(), _succeeded(batch["id"])
                time.sleep(args.bulk_window_s)
                alone_per_s = (_succeeded(batch["id"]) - before) / (time.monotonic() - started)
                sampler.phase, started, before = "calls", time.monotonic(), _succeeded(batch["id"])
                backlog_s, backlog_first_s = _both(ours, args.calls)
                with_calls_per_s = (_succeeded(batch["id"]) - before) / (time.monotonic() - started)
                sampler.phase = None
                left = python_api.get_batch(batch["id"], tenant="bulk")["request_counts"]
                python_api.cancel_batch(batch["id"], tenant="bulk")
        finally:
            sampler.done.set()
            for w in workers:
                w.stop()

    print(
        f"{args.calls} calls and {args.calls} streams each, one at a time; the simulator "
        f"sends its first token after {args.latency_ms:g} ms, then one every "
        f"{args.per_token_ms:g} ms (20 tokens)"
    )
    print(f"{'':26}{'whole call ms':>22}{'first chunk ms':>22}")
    print(f"{'':26}{'p50':>11}{'p99':>11}{'p50':>11}{'p99':>11}")
    rows = {
        "provider alone": (_summary(direct_s), _summary(direct_first_s)),
        "batchgen, idle": (_summary(idle_s), _summary(idle_first_s)),
        "batchgen, under backlog": (_summary(backlog_s), _summary(backlog_first_s)),
    }
    for label, (whole, first) in rows.items():
        print(
            f"{label:26}{whole['p50']:>11.1f}{whole['p99']:>11.1f}"
            f"{first['p50']:>11.1f}{first['p99']:>11.1f}"
        )
    pending = left["pending"] + left["queued"] + left["running"]
    print(f"backlog: {args.backlog} bulk items, {pending} still open when the calls ended")
    print(
        f"calls' reserve: {reserved} of {CONCURRENCY} slots while calls were seen in the "
        f"last {args.recent_s:g} s"
    )
    (alone_bulk, _), (calls_bulk, calls_calls) = sampler.mean("alone"), sampler.mean("calls")
    print(
        f"bulk alone ({args.bulk_window_s:g} s, no recent calls): {alone_per_s:.1f} items/s, "
        f"{alone_bulk:.1f} slots held on average"
    )
    print(
        f"bulk while the calls ran: {with_calls_per_s:.1f} items/s, {calls_bulk:.1f} slots "
        f"held on average (the calls: {calls_calls:.2f}); "
        f"{with_calls_per_s / max(alone_per_s, 1e-9):.2f}x the rate alone"
    )
    (d, df), (i, if_), (b, bf) = rows.values()
    print(
        f"whole call overhead idle: p50 {i['p50'] - d['p50']:.1f} ms, "
        f"p99 {i['p99'] - d['p99']:.1f} ms (target p99 <= 50 ms)"
    )
    print(f"whole call under backlog / idle, p99: {b['p99'] / i['p99']:.2f}x (target <= 2x)")
    print(
        f"first chunk overhead at p50: idle {if_['p50'] - df['p50']:.1f} ms, "
        f"under backlog {bf['p50'] - df['p50']:.1f} ms (target <= 50 ms); "
        f"at p99: idle {if_['p99'] - df['p99']:.1f} ms, under backlog "
        f"{bf['p99'] - df['p99']:.1f} ms"
    )


if __name__ == "__main__":
    main()
