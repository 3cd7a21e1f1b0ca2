"""Do large requests get through a token budget kept busy by small ones?

A mix of 1k-token and 30k-token requests under one 100k tokens/min limit,
driven through the real reservation script (``app/limits/lua/budget_reserve.lua``)
on a real Redis by many simulated workers on a virtual clock (the script
takes ``now_s``), so 30 minutes of traffic take seconds and every run is
reproducible. Each worker loops like a Celery worker does: take the next
request, reserve, and on a denial come back after the wait the script named
(plus the gate's jitter); once granted, the call takes a while, then the next
request. Side by side in one run:

  (a) held claims on (the project's default): the claims of the oldest waiters
      are held, so a request is granted in the order it was first denied
  (b) held claims off (BATCHGEN_BUDGET_HELD_CLAIMS=0, the behaviour before):
      whoever finds room first wins

It prints, per run, the p99 and the longest wait of the large requests (from
their first try to their grant, still-waiting ones counted until the end),
how many were still waiting at the end, and the utilisation: tokens granted in the whole
windows from the first grant on ÷ (limit × those windows).
Target: every large request granted within 2 minutes, utilisation ≥ 0.9.

    .venv/bin/python bench/large_requests.py [--minutes 30] [--workers 32]
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMALL, LARGE = 1_000, 30_000


@dataclass
class Result:
    large_waits_s: list[float] = field(default_factory=list)
    waiting: int = 0  # large requests still waiting at the end
    granted_tokens: list[tuple[float, int]] = field(default_factory=list)
    small: int = 0
    large: int = 0
    calls: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def utilization(grants: list[tuple[float, int]], limit: int, window_s: float) -> float:
    """Granted tokens ÷ the most the limit allows, over the whole windows from the first
    grant to the end (windows aligned on the first grant)."""
    if not grants:
        return 0.0
    first, last = grants[0][0], grants[-1][0]
    windows = int((last - first) // window_s)
    if windows < 1:
        return 0.0
    tokens = sum(t for ts, t in grants if ts < first + windows * window_s)
    return tokens / (windows * limit)


def simulate(args: argparse.Namespace, held_claims: int, redis_url: str, label: str) -> Result:
    import redis

    from batchgen.config import Settings
    from batchgen.limits import redis_keys as keys
    from batchgen.limits.budget import Budget, countdown_s
    from batchgen.registry import ModelSpec

    client = redis.Redis.from_url(redis_url)
    key = f"bench-large-{label}-{os.getpid()}"
    spec = ModelSpec(
        name=key,
        provider="openai",
        base_url="http://bench.invalid/v1",
        api_key_env="K",
        group="bench",
        budget_key=key,
        context_window=128_000,
        max_output_tokens=16_000,
        tokens_per_min=args.tpm,
        requests_per_min=1_000_000,
        max_concurrency=args.workers,
        input_usd_per_1m=1,
        output_usd_per_1m=1,
    )
    budget = Budget(
        client,
        Settings(
            budget_window_s=args.window_s,
            budget_guard_s=args.guard_s,
            budget_held_claims=held_claims,
        ),
    )
    rng = random.Random(args.seed)
    start_s = 1_000_000.0  # virtual clock
    end_s = start_s + args.minutes * 60.0
    wake = [(start_s + rng.uniform(0, 1), w) for w in range(args.workers)]
    heapq.heapify(wake)
    current: dict[int, tuple[str, int, float]] = {}  # worker -> (item, tokens, first try)
    result = Result()
    n = 0
    try:
        while wake:
            now, w = heapq.heappop(wake)
            if now > end_s:
                break
            if w not in current:
                n += 1
                tokens = LARGE if rng.random() < args.large_share else SMALL
                current[w] = (f"i{n}", tokens, now)
            item, tokens, first = current[w]
            result.calls += 1
            grant = budget.reserve(
                spec, f"{item}:{result.calls}", tokens, waiter_id=item, now_s=now
            )
            if grant.granted:
                result.granted_tokens.append((now, tokens))
                if tokens == LARGE:
                    result.large += 1
                    result.large_waits_s.append(now - first)
                else:
                    result.small += 1
                del current[w]
                call_s = args.small_call_s if tokens == SMALL else args.large_call_s
                heapq.heappush(wake, (now + call_s * rng.uniform(0.5, 1.5), w))
            else:
                heapq.heappush(wake, (now + countdown_s(grant.wait_s, rng), w))
        for _item, tokens, first in current.values():
            if tokens == LARGE:
                result.waiting += 1
                result.large_waits_s.append(end_s - first)
    finally:
        for k in client.scan_iter(f"{keys.GATE}budget:{key}:*"):
            client.delete(k)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="virtual minutes")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--tpm", type=int, default=100_000, help="tokens per window")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--guard-s", type=float, default=1.0)
    parser.add_argument(
        "--large-share", type=float, default=0.02, help="share of requests of 30k tokens"
    )
    parser.add_argument("--small-call-s", type=float, default=2.0)
    parser.add_argument("--large-call-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--held-claims", type=int, default=32, help="for run (a)")
    args = parser.parse_args()

    from batchgen import embedded

    server = None
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        workdir = Path(tempfile.mkdtemp(prefix="batchgen-bench-"))
        server = embedded.RedisServer(embedded.free_port(), workdir / "redis").start()
        redis_url = server.url
    try:
        runs = {
            "(a) held claims on": simulate(args, args.held_claims, redis_url, "on"),
            "(b) held claims off (before)": simulate(args, 0, redis_url, "off"),
        }
    finally:
        if server is not None:
            server.stop()
    print(
        f"\nlimit: {args.tpm} tokens per {args.window_s:g} s window (+{args.guard_s:g} s guard); "
        f"{args.workers} workers; {args.minutes:g} virtual minutes; requests of {SMALL} "
        f"and {LARGE} tokens, {100 * args.large_share:g} % large; calls "
        f"{args.small_call_s:g} s / {args.large_call_s:g} s; real Lua on real Redis"
    )
    print(
        f"{'run':30} {'large ok':>8} {'waiting':>7} {'p99 wait s':>10} {'max wait s':>10} "
        f"{'small ok':>8} {'utilisation':>11}"
    )
    for label, r in runs.items():
        print(
            f"{label:30} {r.large:8d} {r.waiting:7d} {percentile(r.large_waits_s, 0.99):10.1f} "
            f"{max(r.large_waits_s, default=0.0):10.1f} {r.small:8d} "
            f"{utilization(r.granted_tokens, args.tpm, args.window_s):11.3f}"
        )


if __name__ == "__main__":
    main()
