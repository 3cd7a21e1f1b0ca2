"""batchgen and the OpenAI cookbook's parallel processor against an independent
token-bucket mock, side by side in one run.

The provider is ``llmock`` 0.2.2 (a mock OpenAI/Anthropic server by a third party:
per API key, a requests bucket and a tokens bucket of capacity ``--rpm`` /
``--tpm``, full at the start and refilled continuously over 60 s; it counts a
request's tokens its own way, ``len(body bytes) // 4 + max_tokens``, and its reset
headers give the time until a bucket is full again). It runs from a throwaway
virtual environment this bench builds (``--llmock-venv``; never a dependency of
the project), through a small launcher that notes each admission decision of
llmock's own limiter (time, tokens as llmock counted them, admitted or refused),
so the figures come from llmock's accounting, not from the clients'.

Each round runs, on a fresh mock (its buckets full), the same ``--requests``
chat requests (mixed lengths, bench/harness.py chat_requests):

- ``cookbook``: an asyncio client written as the OpenAI cookbook's
  ``examples/api_request_parallel_processor.py`` is: tiktoken's estimate of each
  request (prompt + 4 a message + 2 + max_tokens), request and token capacity
  trackers refilled at ``max_requests_per_minute`` / ``max_tokens_per_minute``
  (here exactly llmock's limits), a request sent when both hold it, a failed one
  queued again (5 attempts), and a 15 s pause of the whole loop after an error
  whose message says "Rate limit" (the cookbook's check of an error's text).
  It is the peer: nothing in it is tuned.
- ``batchgen default``: batchgen's default registry entry (no ``limit_shape``:
  learned from the headers, a bucket first) with limits exactly llmock's, 2
  worker processes.
- ``batchgen 2x``: the same with limits twice llmock's (over-configured).

For each: failed requests, llmock's 429s, calls per request, the fraction of the
fastest finish llmock's limits allow (from llmock's own admissions: from the
first admission, a bucket full at the start lets everything through after
``max(0, (admitted - capacity) / refill rate)`` for tokens and for requests,
against the time from the first admission to the last), and the completion time
(the client's start to its last answer; for batchgen, the batch's submit to its
last item's end).

    .venv/bin/python bench/llmock_peer.py [--requests 200] [--tpm 20000] [--rounds 2]

Targets (issue 34): default entry, 200 requests: <= 2 429s and >= 0.95 of the
fastest finish; 2x: 0 failed, <= 1.05 calls per request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    MODEL_TOML,
    chat_requests,
    servers,
    start_celery_worker,
    wait_finished,
)

LLMOCK_VERSION = "0.2.2"
MODEL = "peer"
WORKERS = 2
LLMOCK_WINDOW_S = 60.0  # llmock refills its buckets per minute

# Run by the throwaway venv's interpreter: llmock's server, with each decision of its
# limiter noted in a file ("<monotonic s> <tokens> <1 admitted | 0 refused>").
LAUNCHER = """
import sys, threading, time
import uvicorn
import llmock.ratelimit as ratelimit

port, path = int(sys.argv[1]), sys.argv[2]
lock = threading.Lock()
admit = ratelimit.RateLimiter.admit

def noted(self, provider, key, tokens):
    decision = admit(self, provider, key, tokens)
    with lock, open(path, "a") as out:
        out.write(f"{time.monotonic():.6f} {tokens} {1 if decision.allowed else 0}\\n")
    return decision

ratelimit.RateLimiter.admit = noted
uvicorn.run("llmock.main:create_app", factory=True, host="127.0.0.1", port=port,
            log_level="warning", access_log=False)
"""


def llmock_python(venv: Path) -> Path:
    """The interpreter of a virtual environment holding llmock (made when missing)."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import importlib.metadata as m; print(m.version('llmock'))"]
    if python.exists():
        found = subprocess.run(probe, capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.strip() == LLMOCK_VERSION:
            return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"llmock=={LLMOCK_VERSION}"], check=True
    )
    return python


@contextlib.contextmanager
def llmock_server(
    python: Path, workdir: Path, tpm: int, rpm: int, latency_ms: int
) -> Iterator[tuple[str, Path]]:
    """llmock on a free port with these limits; yields its URL and its decisions file."""
    from batchgen.embedded import free_port

    launcher = workdir / "llmock_launcher.py"
    launcher.write_text(LAUNCHER)
    decisions = workdir / "llmock-decisions.txt"
    decisions.write_text("")
    port = free_port()
    env = {
        **os.environ,
        "LLMOCK_TPM": str(tpm),
        "LLMOCK_RPM": str(rpm),
        "LLMOCK_LATENCY_MS": str(latency_ms),
        "LLMOCK_RESPONSE_STYLE": "static",
    }
    log = open(workdir / "llmock.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [str(python), str(launcher), str(port), str(decisions)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(400):
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{url}/health", timeout=0.5).raise_for_status()
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"llmock did not start: see {workdir / 'llmock.log'}")
        yield url, decisions
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def fresh_mock(url: str, decisions: Path) -> None:
    """Full buckets, an empty journal, no decisions noted."""
    httpx.post(f"{url}/_llmock/reset", timeout=10).raise_for_status()
    decisions.write_text("")


@dataclass
class Accounting:
    """llmock's own decisions during one run."""

    admitted_tokens: int = 0
    admitted: int = 0
    refused: int = 0
    first_s: float = 0.0
    last_s: float = 0.0

    def fastest_s(self, tpm: int, rpm: int) -> float:
        """The least time from the first admission to the last that llmock's buckets
        (full at the start) allow for what it admitted."""
        token_s = (self.admitted_tokens - tpm) / (tpm / LLMOCK_WINDOW_S)
        request_s = (self.admitted - rpm) / (rpm / LLMOCK_WINDOW_S)
        return max(0.0, token_s, request_s)

    @property
    def span_s(self) -> float:
        return self.last_s - self.first_s


def read_decisions(path: Path) -> Accounting:
    acc = Accounting()
    times: list[float] = []
    for line in path.read_text().splitlines():
        t, tokens, allowed = line.split()
        if allowed == "1":
            acc.admitted += 1
            acc.admitted_tokens += int(tokens)
            times.append(float(t))
        else:
            acc.refused += 1
    if times:
        acc.first_s, acc.last_s = min(times), max(times)
    return acc


# --- the peer: the OpenAI cookbook's api_request_parallel_processor.py, as it is ----------


@dataclass
class StatusTracker:
    num_tasks_started: int = 0
    num_tasks_in_progress: int = 0
    num_tasks_succeeded: int = 0
    num_tasks_failed: int = 0
    num_rate_limit_errors: int = 0
    num_api_errors: int = 0
    num_other_errors: int = 0
    time_of_last_rate_limit_error: float = 0.0


@dataclass
class APIRequest:
    task_id: int
    request_json: dict[str, Any]
    token_consumption: int
    attempts_left: int
    result: list[Any] = field(default_factory=list)

    async def call_api(
        self,
        session: Any,
        request_url: str,
        request_header: dict[str, str],
        retry_queue: asyncio.Queue[APIRequest],
        status_tracker: StatusTracker,
    ) -> None:
        error: Any = None
        try:
            async with session.post(
                url=request_url, headers=request_header, json=self.request_json
            ) as response:
                response = await response.json()
            if "error" in response:
                status_tracker.num_api_errors += 1
                error = response
                if "Rate limit" in str(response["error"].get("message", "")):
                    status_tracker.time_of_last_rate_limit_error = time.time()
                    status_tracker.num_rate_limit_errors += 1
                    status_tracker.num_api_errors -= 1
        except Exception as e:  # the cookbook's: logged and retried
            status_tracker.num_other_errors += 1
            error = e
        if error:
            self.result.append(error)
            if self.attempts_left:
                retry_queue.put_nowait(self)
            else:
                status_tracker.num_tasks_in_progress -= 1
                status_tracker.num_tasks_failed += 1
        else:
            status_tracker.num_tasks_in_progress -= 1
            status_tracker.num_tasks_succeeded += 1


def num_tokens_consumed_from_request(request_json: dict[str, Any], encoding: Any) -> int:
    """The cookbook's estimate of a chat completion: prompt + 4 a message + 2 +
    n * max_tokens."""
    completion_tokens = request_json.get("n", 1) * request_json.get("max_tokens", 15)
    num_tokens = 0
    for message in request_json["messages"]:
        num_tokens += 4
        for key, value in message.items():
            num_tokens += len(encoding.encode(value))
            if key == "name":
                num_tokens -= 1
    num_tokens += 2
    return num_tokens + completion_tokens


async def cookbook_client(
    request_url: str,
    requests: list[dict[str, Any]],
    max_requests_per_minute: float,
    max_tokens_per_minute: float,
    max_attempts: int = 5,
) -> StatusTracker:
    """The cookbook's main loop (process_api_requests_from_file), reading a list."""
    import aiohttp

    from batchgen.domain.formats.tokens import get_encoding

    seconds_to_pause_after_rate_limit_error = 15
    seconds_to_sleep_each_loop = 0.001
    # tiktoken's cl100k_base, from the packaged file (tiktoken.get_encoding would
    # download it; this machine has no network).
    encoding = get_encoding("cl100k_base")
    request_header = {"Authorization": "Bearer sk-cookbook"}
    queue_of_requests_to_retry: asyncio.Queue[APIRequest] = asyncio.Queue()
    status_tracker = StatusTracker()
    next_request: APIRequest | None = None
    available_request_capacity = max_requests_per_minute
    available_token_capacity = max_tokens_per_minute
    last_update_time = time.time()
    pending = iter(requests)
    file_not_finished = True
    task_ids = iter(range(10**9))
    async with aiohttp.ClientSession() as session:
        while True:
            if next_request is None:
                if not queue_of_requests_to_retry.empty():
                    next_request = queue_of_requests_to_retry.get_nowait()
                elif file_not_finished:
                    try:
                        request_json = next(pending)
                        next_request = APIRequest(
                            task_id=next(task_ids),
                            request_json=request_json,
                            token_consumption=num_tokens_consumed_from_request(
                                request_json, encoding
                            ),
                            attempts_left=max_attempts,
                        )
                        status_tracker.num_tasks_started += 1
                        status_tracker.num_tasks_in_progress += 1
                    except StopIteration:
                        file_not_finished = False

            current_time = time.time()
            seconds_since_update = current_time - last_update_time
            available_request_capacity = min(
                available_request_capacity + max_requests_per_minute * seconds_since_update / 60.0,
                max_requests_per_minute,
            )
            available_token_capacity = min(
                available_token_capacity + max_tokens_per_minute * seconds_since_update / 60.0,
                max_tokens_per_minute,
            )
            last_update_time = current_time

            if next_request:
                next_request_tokens = next_request.token_consumption
                if (
                    available_request_capacity >= 1
                    and available_token_capacity >= next_request_tokens
                ):
                    available_request_capacity -= 1
                    available_token_capacity -= next_request_tokens
                    next_request.attempts_left -= 1
                    asyncio.create_task(  # noqa: RUF006 (the cookbook's fire and forget)
                        next_request.call_api(
                            session=session,
                            request_url=request_url,
                            request_header=request_header,
                            retry_queue=queue_of_requests_to_retry,
                            status_tracker=status_tracker,
                        )
                    )
                    next_request = None

            if status_tracker.num_tasks_in_progress == 0:
                break

            await asyncio.sleep(seconds_to_sleep_each_loop)

            seconds_since_rate_limit_error = (
                time.time() - status_tracker.time_of_last_rate_limit_error
            )
            if seconds_since_rate_limit_error < seconds_to_pause_after_rate_limit_error:
                remaining_seconds_to_pause = (
                    seconds_to_pause_after_rate_limit_error - seconds_since_rate_limit_error
                )
                await asyncio.sleep(remaining_seconds_to_pause)
    return status_tracker


# --- the runs -----------------------------------------------------------------------------


@dataclass
class Run:
    label: str
    n: int
    failed: int
    completion_s: float
    acc: Accounting


def run_cookbook(url: str, decisions: Path, args: argparse.Namespace) -> Run:
    fresh_mock(url, decisions)
    bodies = [row["body"] for row in chat_requests(args.requests, MODEL, "cookbook")]
    started = time.monotonic()
    tracker = asyncio.run(
        cookbook_client(f"{url}/v1/chat/completions", bodies, float(args.rpm), float(args.tpm))
    )
    elapsed = time.monotonic() - started
    return Run(
        "cookbook (asyncio)",
        args.requests,
        tracker.num_tasks_failed,
        elapsed,
        read_decisions(decisions),
    )


def _reset_batchgen() -> None:
    from bench.harness import reset_state

    reset_state(None)


def run_batchgen(
    label: str, factor: int, url: str, decisions: Path, args: argparse.Namespace, workdir: Path
) -> Run:
    from batchgen import python_api as client
    from batchgen.api import load_encodings
    from batchgen.store import db, tenants
    from bench.peer import _completion_s, _use_registry

    _reset_batchgen()
    fresh_mock(url, decisions)
    models_file = workdir / f"models-llmock-{factor}.toml"
    # The default entry: no limit_shape (learned from llmock's headers).
    models_file.write_text(
        MODEL_TOML.format(
            name=MODEL,
            base_url=url,
            tpm=factor * args.tpm,
            rpm=factor * args.rpm,
            concurrency=WORKERS * args.concurrency,
        )
    )
    env = {"BATCHGEN_LOG_LEVEL": "WARNING"}
    _use_registry(models_file, env)
    tenant = f"llmock-{factor}-{time.monotonic_ns()}"
    with db.session_scope() as s:
        tenants.create_tenant(s, tenant)
    worker_env = {**env, "BATCHGEN_MODELS_FILE": str(models_file)}
    workers = [
        start_celery_worker(
            "batchgen.tasks",
            [f"llm.{MODEL}", "batchgen.control"],
            log_dir=workdir / "logs" / f"{label}-{factor}",
            concurrency=args.concurrency,
            beat=i == 0,
            env=worker_env,
            name=f"llmock{factor}w{i}",
        )
        for i in range(WORKERS)
    ]
    try:
        for w in workers:
            w.wait_ready()
        load_encodings()
        batch = client.submit_batch(chat_requests(args.requests, MODEL, "batchgen"), tenant=tenant)
        wait_finished([batch["id"]], timeout_s=args.timeout_s)
    finally:
        for w in workers:
            w.stop()
    counts = client.get_batch(batch["id"], tenant=tenant)["request_counts"]
    return Run(
        label,
        args.requests,
        counts["failed"],
        _completion_s(batch["id"]),
        read_decisions(decisions),
    )


def learned_shape() -> str:
    from batchgen.limits import redis_keys as keys
    from batchgen.limits.backend import get_redis

    raw = get_redis().hget(keys.budget_shape(f"{MODEL}-account"), "shape")
    return raw.decode() if isinstance(raw, bytes) else "bucket (no sample against)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tpm", type=int, default=20_000, help="llmock's tokens per minute")
    parser.add_argument("--rpm", type=int, default=600, help="llmock's requests per minute")
    parser.add_argument("--latency-ms", type=int, default=200, help="llmock's answer time")
    parser.add_argument("--concurrency", type=int, default=16, help="threads per worker")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument(
        "--only", default="cookbook,default,2x", help="comma-separated: cookbook, default, 2x"
    )
    parser.add_argument(
        "--llmock-venv",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "batchgen-bench"
        / f"llmock-{LLMOCK_VERSION}",
        help="the throwaway virtual environment llmock runs from (made when missing)",
    )
    args = parser.parse_args()
    wanted = set(args.only.split(","))
    python = llmock_python(args.llmock_venv)
    rows: list[tuple[int, Run, str]] = []
    with (
        servers() as workdir,
        llmock_server(python, workdir, args.tpm, args.rpm, args.latency_ms) as (url, decisions),
    ):
        for round_ in range(1, args.rounds + 1):
            if "cookbook" in wanted:
                rows.append((round_, run_cookbook(url, decisions, args), ""))
            for factor, name in ((1, "default"), (2, "2x")):
                if name in wanted:
                    label = f"batchgen {name} entry" if factor == 1 else "batchgen limits 2x"
                    run = run_batchgen(label, factor, url, decisions, args, workdir)
                    rows.append((round_, run, learned_shape()))
    load = os.getloadavg()
    print(
        f"\nllmock {LLMOCK_VERSION}: token buckets of {args.tpm} tokens and {args.rpm} requests, "
        f"refilled over 60 s, own count (body bytes // 4 + max_tokens); {args.requests} "
        f"requests, {args.latency_ms} ms answers; batchgen {WORKERS} workers x "
        f"{args.concurrency}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(
        f"{'round':>5} {'client':26} {'failed':>6} {'429s':>5} {'calls/req':>9} "
        f"{'fastest s':>9} {'span s':>7} {'of fastest':>10} {'done s':>7} {'tokens':>7} "
        f"{'shape':>8}"
    )
    for round_, r, shape in rows:
        acc = r.acc
        fastest = acc.fastest_s(args.tpm, args.rpm)
        share = fastest / acc.span_s if acc.span_s > 0 else float("nan")
        calls = (acc.admitted + acc.refused) / r.n
        print(
            f"{round_:5d} {r.label:26} {r.failed:6d} {acc.refused:5d} {calls:9.3f} "
            f"{fastest:9.2f} {acc.span_s:7.2f} {share:10.3f} {r.completion_s:7.2f} "
            f"{acc.admitted_tokens:7d} {(shape or '-').split()[0]:>8}"
        )


if __name__ == "__main__":
    main()
