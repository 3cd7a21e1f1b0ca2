"""A tenant's batches and synchronous calls, alone and beside a hostile tenant (#27).

Side by side in one run (under 3 minutes), on embedded PostgreSQL and Redis, a
simulator process (fixed answer time), a ``batchgen api`` process and real Celery
worker processes, tenant ``calm`` submits small batches one after another (a
batch's latency: from submit to its end) while it makes chat completion calls one
at a time, each with a deadline (``X-Request-Timeout``) that the provider alone
meets many times over. Three phases of ``--phase-s`` seconds:

1. **alone**;
2. **beside flood + chunked body**: tenant ``hostile`` keeps ``--flood`` parallel
   synchronous calls on the same model without pause, and sends a
   ``--chunked-mib`` MiB chunked body (no Content-Length) with no API key to
   ``/v1/chat/completions``;
3. **... + drip webhook**: the same, and ``hostile`` submits batches whose webhook
   is a receiver on 127.0.0.1 that answers one byte every 3 s
   (``BATCHGEN_WEBHOOK_ALLOW_NETS='["127.0.0.0/8"]'`` lets the bench name a
   loopback receiver on purpose).

Prints, per phase, p50 / p99 of calm's batch latency and of its answered calls,
each p99 over the one alone (target: within 2x), calm's batches not ended
``GRACE_S`` after the phase, calm's calls that did not answer 200 (target: no 504),
the flood's answers by status, and the API process's peak memory.

    .venv/bin/python bench/noisy_neighbour.py [--phase-s 20] [--flood 40] [--latency-ms 500]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.server
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    api_process,
    chat_requests,
    live_model_env,
    process_tree,
    servers,
    simulator_process,
    start_celery_worker,
)

MODEL = "live"
CONCURRENCY = 8
WORKERS = 2
WORKER_THREADS = 8
CALL_DEADLINE_S = 10.0
BATCH_ITEMS = 8
DRIP_EVERY_S = 3.0
ALLOW_LOOPBACK = '["127.0.0.0/8"]'
OPEN_BATCH = ("in_progress", "cancelling")
# How long a phase's last batch may take after the phase (then it counts as unfinished).
GRACE_S = 15.0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class _Drip(http.server.BaseHTTPRequestHandler):
    """A webhook receiver that reads the POST, then answers one byte every 3 s."""

    stop = threading.Event()
    posts = 0  # deliveries that reached it: the attack did hit

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        _Drip.posts += 1
        with contextlib.suppress(OSError):
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
            for _ in range(100):
                if self.stop.wait(DRIP_EVERY_S):
                    return
                self.wfile.write(b"x")
                self.wfile.flush()

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _drip_receiver() -> Iterator[str]:
    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), _Drip)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        _Drip.stop.set()
        server.shutdown()


def _call(client: httpx.Client, key: str, deadline_s: float | None) -> tuple[int, float]:
    headers = {"Authorization": f"Bearer {key}"}
    if deadline_s is not None:
        headers["X-Request-Timeout"] = f"{deadline_s:g}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    started = time.perf_counter()
    try:
        status = client.post("/v1/chat/completions", json=body, headers=headers).status_code
    except httpx.HTTPError:
        status = 0  # the connection failed or timed out
    return status, time.perf_counter() - started


def _calm(api: str, key: str, until: float) -> dict[str, Any]:
    """Calm's workload until ``until``: batches one after another, and calls one at a
    time beside them. Returns the latencies (s) and the calls' statuses."""
    from batchgen import python_api

    batch_s: list[float] = []
    calls: list[tuple[int, float]] = []
    unfinished: list[str] = []

    def batches() -> None:
        n = 0
        while time.monotonic() < until:
            lines = chat_requests(BATCH_ITEMS, MODEL, f"calm-{n}", seed=n)
            started = time.perf_counter()
            batch = python_api.submit_batch(lines, tenant="calm")
            while python_api.get_batch(batch["id"], tenant="calm")["status"] in OPEN_BATCH:
                if time.monotonic() > until + GRACE_S:
                    unfinished.append(batch["id"])
                    python_api.cancel_batch(batch["id"], tenant="calm")
                    return
                time.sleep(0.05)
            batch_s.append(time.perf_counter() - started)
            n += 1

    runner = threading.Thread(target=batches, daemon=True)
    runner.start()
    with httpx.Client(base_url=api, timeout=CALL_DEADLINE_S + 30) as client:
        while time.monotonic() < until:
            calls.append(_call(client, key, CALL_DEADLINE_S))
    runner.join(GRACE_S + 30)
    return {"batch_s": batch_s, "calls": calls, "unfinished": len(unfinished)}


def _hostile(
    api: str, key: str, hook: str | None, args: argparse.Namespace
) -> Callable[[], dict[str, Any]]:
    """Start the hostile tenant's attacks (the drip webhook only with a ``hook``);
    returns a function that stops them and says what they got."""
    from batchgen import python_api

    stop = threading.Event()
    flood: collections.Counter[int] = collections.Counter()
    chunked: dict[str, Any] = {}

    def flood_one() -> None:
        with httpx.Client(base_url=api, timeout=700) as client:
            while not stop.is_set():
                flood[_call(client, key, None)[0]] += 1

    def drip_batches() -> None:
        n = 0
        while not stop.is_set() and n < args.drip_batches:
            python_api.submit_batch(
                chat_requests(1, MODEL, f"drip-{n}"), tenant="hostile", webhook_url=hook
            )
            n += 1
            stop.wait(1.0)

    def body() -> Iterator[bytes]:
        chunk = b"{" + b" " * (1024 * 1024 - 1)
        for _ in range(args.chunked_mib):
            if stop.is_set():
                return
            yield chunk

    def chunked_body() -> None:
        started = time.perf_counter()
        try:
            answer = httpx.post(f"{api}/v1/chat/completions", content=body(), timeout=120)
            chunked["status"] = answer.status_code
        except httpx.HTTPError as exc:
            chunked["status"] = type(exc).__name__
        chunked["s"] = time.perf_counter() - started

    threads = [threading.Thread(target=flood_one, daemon=True) for _ in range(args.flood)]
    if hook is not None:
        threads += [threading.Thread(target=drip_batches, daemon=True)]
    if args.chunked_mib > 0:
        threads += [threading.Thread(target=chunked_body, daemon=True)]
    for t in threads:
        t.start()

    def finish() -> dict[str, Any]:
        stop.set()
        for t in threads:
            t.join(30)
        return {"flood": dict(flood), "chunked": chunked}

    return finish


def _rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _peak_rss(pid: int, stop: threading.Event, out: dict[str, float]) -> None:
    """The API process tree's peak resident memory (MiB), sampled every 0.2 s."""
    while not stop.wait(0.2):
        rss_mib = sum(_rss_kib(p) for p in process_tree(pid)) / 1024
        out["peak_mib"] = max(out.get("peak_mib", 0.0), rss_mib)


PHASES = (
    ("alone", False, False),
    ("beside flood + chunked body", True, False),
    ("beside flood + chunked + drip webhook", True, True),
)


def _report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    print(
        f"model: {CONCURRENCY} slots, simulator answers in {args.latency_ms:g} ms; "
        f"{args.phase_s:g} s per phase; calm's calls have a {CALL_DEADLINE_S:g} s deadline, "
        f"its batches {BATCH_ITEMS} items (one after another)"
    )
    head = f"{'calm tenant, phase':40}{'batches':>8}{'p50 ms':>9}{'p99 ms':>9}{'x alone':>8}"
    print(head + f"{'unfin.':>7}{'calls':>7}{'p50 ms':>9}{'p99 ms':>9}{'x alone':>8}  not 200")
    base_batch = base_call = float("nan")
    for (label, _, _), phase in zip(PHASES, results, strict=False):
        ok = [t for status, t in phase["calls"] if status == 200]
        failed = collections.Counter(status for status, _ in phase["calls"] if status != 200)
        b50, b99 = (_percentile(phase["batch_s"], q) * 1000 for q in (0.5, 0.99))
        c50, c99 = (_percentile(ok, q) * 1000 for q in (0.5, 0.99))
        if label == "alone":
            base_batch, base_call = b99, c99
        print(
            f"{label:40}{len(phase['batch_s']):>8}{b50:>9.0f}{b99:>9.0f}{b99 / base_batch:>8.2f}"
            f"{phase['unfinished']:>7}{len(phase['calls']):>7}{c50:>9.0f}{c99:>9.0f}"
            f"{c99 / base_call:>8.2f}  {dict(failed) or 'none'}"
        )
        if "attacks" in phase:
            attacks = phase["attacks"]
            print(f"{'':4}hostile: flood answers by status {attacks['flood']}")
            print(
                f"{'':4}hostile: {args.chunked_mib} MiB chunked body, no key: "
                f"{attacks['chunked'] or 'not sent'}; API memory peak {phase['peak_mib']:.0f} MiB"
            )
            if "drip_posts" in attacks:
                print(
                    f"{'':4}hostile: webhook deliveries the drip receiver held: "
                    f"{attacks['drip_posts']}"
                )
    print("targets: p99 beside the hostile tenant <= 2x alone; no 504 for calm's calls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--flood", type=int, default=40)
    parser.add_argument("--latency-ms", type=float, default=500.0)
    parser.add_argument("--drip-batches", type=int, default=4)
    parser.add_argument("--chunked-mib", type=int, default=300)
    args = parser.parse_args()

    from batchgen.store import db, tenants
    from batchgen.worker.names import CONTROL_QUEUE, NOTIFY_QUEUE

    sim_args = ("--latency-base-ms", str(args.latency_ms), "--per-token-ms", "0")
    with simulator_process(*sim_args) as sim, servers() as workdir, _drip_receiver() as hook:
        env = live_model_env(
            workdir, MODEL, sim, CONCURRENCY, BATCHGEN_WEBHOOK_ALLOW_NETS=ALLOW_LOOPBACK
        )
        with db.session_scope() as s:
            _, calm_key = tenants.create_tenant(s, "calm")
            _, hostile_key = tenants.create_tenant(s, "hostile")

        workers = [
            start_celery_worker(
                "batchgen.tasks",
                # As `batchgen worker` runs: the model's queue and the notifications'
                # (webhooks are sent there, never on the dispatcher's threads).
                [f"llm.{MODEL}", CONTROL_QUEUE, NOTIFY_QUEUE],
                log_dir=workdir / "logs",
                concurrency=WORKER_THREADS,
                beat=i == 0,
                env=env,
                name=f"w{i}",
            )
            for i in range(WORKERS)
        ]
        results: list[dict[str, Any]] = []
        try:
            for w in workers:
                w.wait_ready()
            with api_process(env, workdir / "api.log") as (api, api_pid):
                with httpx.Client(base_url=api, timeout=30) as client:
                    for _ in range(3):  # warm up
                        _call(client, calm_key, CALL_DEADLINE_S)
                for _, hostile, drip in PHASES:
                    memory: dict[str, float] = {}
                    watching = threading.Event()
                    threading.Thread(
                        target=_peak_rss, args=(api_pid, watching, memory), daemon=True
                    ).start()
                    finish = None
                    if hostile:
                        finish = _hostile(api, hostile_key, hook if drip else None, args)
                        time.sleep(2.0)  # the flood fills the slots
                    phase = _calm(api, calm_key, time.monotonic() + args.phase_s)
                    if finish is not None:
                        phase["attacks"] = finish()
                        if drip:
                            phase["attacks"]["drip_posts"] = _Drip.posts
                    watching.set()
                    phase["peak_mib"] = memory.get("peak_mib", 0.0)
                    results.append(phase)
        finally:
            for w in workers:
                w.stop()
    _report(args, results)


if __name__ == "__main__":
    main()
