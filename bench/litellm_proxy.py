"""Synchronous calls through batchgen's API and through LiteLLM's proxy, side by side.

In one run, on the same provider (the simulator, in a process of its own), the same
requests go three ways: straight to the simulator (the provider alone), through
LiteLLM's proxy (``litellm --config``, version ``--litellm-version``, no database,
one master key, its defaults otherwise) and through ``batchgen api`` (the command its
docs say to run in production; embedded PostgreSQL and Redis). For each kind of call
(``POST /v1/chat/completions``, ``/v1/messages``, ``/v1/responses`` whole and streamed,
``/v1/embeddings``) and each concurrency (1, 16, 64 by default), each side answers
``--requests`` requests, one side after the other, and the bench prints one table:

* CPU per request: every process of the side (LiteLLM: its proxy's process tree;
  batchgen: the API's process tree, PostgreSQL's and Redis's), read from
  ``/proc/<pid>/stat`` before and after; the simulator's CPU is left out of both;
  a line per batchgen row after the table splits it by process (api, postgres, redis);
* requests per second, and p50 / p99 of a whole request, and what each adds to the
  provider's own at the same concurrency;
* for streams, the time to the first chunk (the first server-sent event read), p50
  and p99, and what it adds to the provider's.

Then one line per figure says which side is ahead. LiteLLM runs in a throwaway virtual
environment this bench makes (``--litellm-venv``; built once: LiteLLM's wheel and its
proxy's dependencies, installed by hand because its ``proxy`` extra does not resolve
here); nothing of it is a dependency of batchgen.

    .venv/bin/python bench/litellm_proxy.py [--requests 200] [--concurrency 1,16,64]
        [--kinds chat,chat-stream,...] [--latency-ms 20] [--per-token-ms 1]
        [--litellm-venv /tmp/batchgen-bench-litellm-1.110.2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (  # noqa: E402
    api_process,
    live_model_env,
    postgres_server_pid,
    redis_server_pid,
    servers,
    simulator_process,
    tree_cpu_s,
)

MODEL = "live"
CLAUDE = "live-claude"
EMBED = "live-embed"
LITELLM_VERSION = "1.110.2"
MASTER_KEY = "sk-bench-master"
# The proxy's own dependencies (its ``proxy`` extra names packages the index here does
# not have): what ``litellm --config`` imports to start.
PROXY_DEPS = (
    "fastapi",
    "uvicorn",
    "uvloop",
    "orjson",
    "apscheduler",
    "backoff",
    "pyjwt",
    "cryptography",
    "python-multipart",
    "email-validator",
    "websockets>=15.0.1,<16",
    "pyyaml",
    "rq",
    "hiredis",
    "fastapi-sso",
    "pynacl",
    "mcp",
    "semver",
    "expression",
    "soundfile",
)
# No download at import, no telemetry.
LITELLM_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}

# batchgen's settings that LiteLLM would read as its own.
OWN_ENV = ("DATABASE_URL", "DIRECT_URL", "REDIS_URL", "REDIS_HOST", "REDIS_PORT")

CLAUDE_TOML = """
[models."{name}"]
provider = "anthropic"
base_url = "{base_url}"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "{name}"
budget_key = "{name}-account"
context_window = 16384
max_output_tokens = 400
tokens_per_min = 1000000000
requests_per_min = 1000000000
max_concurrency = {concurrency}
input_usd_per_1m = 3.0
output_usd_per_1m = 15.0
encoding = "cl100k_base"
charge_policy = "reserve"
max_attempts = 50

[models."{embed}"]
provider = "openai"
base_url = "{base_url}/v1"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "{embed}"
budget_key = "{embed}-account"
endpoints = ["/v1/embeddings"]
dimensions = 1536
context_window = 8192
tokens_per_min = 1000000000
requests_per_min = 1000000000
max_concurrency = {concurrency}
input_usd_per_1m = 0.02
output_usd_per_1m = 0.0
encoding = "cl100k_base"
"""

LITELLM_CONFIG = """model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {sim}/v1
      api_key: bench
  - model_name: {claude}
    litellm_params:
      model: anthropic/{claude}
      api_base: {sim}
      api_key: bench
  - model_name: {embed}
    litellm_params:
      model: openai/{embed}
      api_base: {sim}/v1
      api_key: bench
general_settings:
  master_key: {master}
litellm_settings:
  telemetry: false
"""


@dataclass(frozen=True)
class Kind:
    name: str
    path: str
    body: Callable[[int, int], dict[str, Any]]
    stream: bool = False
    anthropic: bool = False


def _chat(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Say something about request {i}."}],
        "max_tokens": max_tokens,
    }


def _messages(i: int, max_tokens: int) -> dict[str, Any]:
    return {**_chat(i, max_tokens), "model": CLAUDE}


def _responses(i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "input": f"Say something about request {i}.", "max_output_tokens": 16}


def _embeddings(i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": EMBED, "input": f"request {i}"}


def _streamed(body: Callable[[int, int], dict[str, Any]]) -> Callable[[int, int], dict[str, Any]]:
    return lambda i, max_tokens: {**body(i, max_tokens), "stream": True}


KINDS = {
    k.name: k
    for k in (
        Kind("chat", "/v1/chat/completions", _chat),
        Kind("chat-stream", "/v1/chat/completions", _streamed(_chat), stream=True),
        Kind("messages", "/v1/messages", _messages, anthropic=True),
        Kind("messages-stream", "/v1/messages", _streamed(_messages), True, True),
        Kind("responses", "/v1/responses", _responses),
        Kind("embeddings", "/v1/embeddings", _embeddings),
    )
}


@dataclass
class Side:
    name: str
    base_url: str
    key: str
    # The processes whose CPU is the side's (their trees), by what each is.
    processes: dict[str, int] = field(default_factory=dict)

    def cpu_parts_s(self) -> dict[str, float]:
        return {name: tree_cpu_s(pid) or 0.0 for name, pid in self.processes.items()}


@dataclass
class Run:
    ok: int
    errors: dict[str, int]
    wall_s: float
    cpu_s: float
    latencies_s: list[float]
    first_s: list[float]
    # The CPU seconds of each of the side's processes (Side.processes).
    cpu_parts_s: dict[str, float] = field(default_factory=dict)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _code(body: bytes) -> str:
    """The error code (or type) of an error answer, for the count of errors by kind."""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return "?"
    return str(error.get("code") or error.get("type") or "?") if isinstance(error, dict) else "?"


async def _one(
    session: aiohttp.ClientSession, side: Side, kind: Kind, body: dict[str, Any]
) -> tuple[float, float | None, str | None]:
    headers = {"Authorization": f"Bearer {side.key}", "Content-Type": "application/json"}
    if kind.anthropic:
        headers |= {"anthropic-version": "2023-06-01", "x-api-key": side.key}
    started = time.perf_counter()
    first: float | None = None
    async with session.post(side.base_url + kind.path, data=json.dumps(body), headers=headers) as r:
        if kind.stream:
            async for line in r.content:
                if first is None and line.startswith(b"data:"):
                    first = time.perf_counter() - started
        else:
            await r.read()
        error = None if r.status == 200 else f"http {r.status} {_code(await r.read())}"
        if kind.stream and first is None and error is None:
            error = "no chunk"
    return time.perf_counter() - started, first, error


async def _run(side: Side, kind: Kind, n: int, concurrency: int, max_tokens: int) -> Run:
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    latencies: list[float] = []
    firsts: list[float] = []
    errors: dict[str, int] = {}
    todo = iter(range(n))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            for i in todo:
                try:
                    took, first, error = await _one(session, side, kind, kind.body(i, max_tokens))
                except Exception as exc:  # noqa: BLE001 - counted by kind
                    took, first, error = 0.0, None, type(exc).__name__
                if error:
                    errors[error] = errors.get(error, 0) + 1
                    continue
                latencies.append(took)
                if first is not None:
                    firsts.append(first)

        before = side.cpu_parts_s()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
        parts = {name: cpu_s - before[name] for name, cpu_s in side.cpu_parts_s().items()}
    return Run(len(latencies), errors, wall_s, sum(parts.values()), latencies, firsts, parts)


def _litellm_python(venv: Path, version: str) -> Path:
    """The venv's interpreter, the venv built first when it has no ``litellm`` yet."""
    python = venv / "bin" / "python"
    marker = venv / f".litellm-{version}-ready"
    if marker.exists():
        return python
    print(f"building {venv} (litellm=={version} and its proxy's dependencies)...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"litellm=={version}", *PROXY_DEPS], check=True)
    check = [str(python), "-c", "import litellm.proxy.proxy_server"]
    subprocess.run(check, check=True, env={**os.environ, **LITELLM_ENV})
    marker.touch()
    return python


@contextlib.contextmanager
def litellm_proxy(python: Path, sim_url: str, workdir: Path) -> Iterator[tuple[str, int]]:
    """``litellm --config`` on a free port, in front of the simulator; its URL and pid."""
    from batchgen.embedded import free_port

    config = workdir / "litellm.yaml"
    config.write_text(
        LITELLM_CONFIG.format(
            model=MODEL, claude=CLAUDE, embed=EMBED, sim=sim_url, master=MASTER_KEY
        )
    )
    port = free_port()
    log = open(workdir / "litellm.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(python.parent / "litellm"), "--config", str(config), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        # No database, no Redis: LiteLLM would use batchgen's (DATABASE_URL, REDIS_URL).
        env={**{k: v for k, v in os.environ.items() if k not in OWN_ENV}, **LITELLM_ENV},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health/liveliness", timeout=0.5).status_code == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"the LiteLLM proxy exited; see {workdir / 'litellm.log'}")
            time.sleep(0.1)
        yield url, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
        log.close()


def _row(label: str, run: Run, direct: Run | None, stream: bool) -> dict[str, Any]:
    lat = [s * 1000 for s in run.latencies_s]
    first = [s * 1000 for s in run.first_s]
    row: dict[str, Any] = {
        "side": label,
        "ok": run.ok,
        "errors": sum(run.errors.values()),
        "cpu_ms": run.cpu_s * 1000 / max(1, run.ok) if label != "provider" else None,
        "cpu_ms_by_process": {
            name: cpu_s * 1000 / max(1, run.ok) for name, cpu_s in run.cpu_parts_s.items()
        },
        "req_s": run.ok / run.wall_s if run.wall_s else 0.0,
        "p50": _pct(lat, 0.5),
        "p99": _pct(lat, 0.99),
        "first50": _pct(first, 0.5) if stream else None,
        "first99": _pct(first, 0.99) if stream else None,
    }
    if direct is not None and label != "provider":
        base = [s * 1000 for s in direct.latencies_s]
        row["add50"] = row["p50"] - _pct(base, 0.5)
        row["add99"] = row["p99"] - _pct(base, 0.99)
        if stream:
            base_first = [s * 1000 for s in direct.first_s]
            row["addfirst50"] = row["first50"] - _pct(base_first, 0.5)
            row["addfirst99"] = row["first99"] - _pct(base_first, 0.99)
    return row


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'kind':17}{'conc':>5} {'side':9}{'ok':>5}{'err':>5}{'cpu ms/req':>11}{'req/s':>8}"
        f"{'p50':>8}{'p99':>8}{'+p50':>8}{'+p99':>8}{'1st p50':>9}{'1st p99':>9}"
        f"{'+1st p50':>10}{'+1st p99':>10}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['kind']:17}{r['conc']:>5} {r['side']:9}{r['ok']:>5}{r['errors']:>5}"
            f"{_fmt(r['cpu_ms']):>11}{r['req_s']:>8.1f}{r['p50']:>8.1f}{r['p99']:>8.1f}"
            f"{_fmt(r.get('add50')):>8}{_fmt(r.get('add99')):>8}"
            f"{_fmt(r['first50']):>9}{_fmt(r['first99']):>9}"
            f"{_fmt(r.get('addfirst50')):>10}{_fmt(r.get('addfirst99')):>10}"
        )


def cpu_split(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row of a side of several processes: its CPU a request by process."""
    lines = []
    for r in rows:
        split = r.get("cpu_ms_by_process") or {}
        if len(split) > 1:
            parts = ", ".join(f"{name} {ms:.1f}" for name, ms in split.items())
            lines.append(f"{r['kind']:17} c={r['conc']:<3} {r['side']:9} cpu ms/req: {parts}")
    return lines


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per figure: batchgen's against LiteLLM's, and who is ahead."""
    by = {(r["kind"], r["conc"], r["side"]): r for r in rows}
    lines = []
    top = max(r["conc"] for r in rows)
    low = min(r["conc"] for r in rows)
    for (kind, conc, side), ours in by.items():
        theirs = by.get((kind, conc, "litellm"))
        if side != "batchgen" or theirs is None:
            continue
        figures = [("cpu ms/req", "cpu_ms", False)]
        if conc == top:
            figures.append(("req/s", "req_s", True))
        if conc == low:
            figures += [("+p50 ms", "add50", False), ("+p99 ms", "add99", False)]
            if ours.get("addfirst50") is not None:
                figures += [("+1st chunk p50", "addfirst50", False)]
                figures += [("+1st chunk p99", "addfirst99", False)]
        for label, key, higher_better in figures:
            a, b = ours.get(key), theirs.get(key)
            if a is None or b is None:
                continue
            ahead = a > b if higher_better else a < b
            mark = "ahead" if ahead else "BEHIND"
            lines.append(
                f"{kind:17} c={conc:<3} {label:15} batchgen {a:8.1f}  litellm {b:8.1f}  {mark}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="per kind, concurrency, side")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--sides", default="provider,litellm,batchgen")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="the simulator's base")
    parser.add_argument("--per-token-ms", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=20, help="requests per side and kind")
    parser.add_argument("--litellm-version", default=LITELLM_VERSION)
    parser.add_argument("--litellm-venv", default=None)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    kinds = [KINDS[k] for k in args.kinds.split(",")]
    wanted = args.sides.split(",")
    venv = Path(args.litellm_venv or f"/tmp/batchgen-bench-litellm-{args.litellm_version}")
    python = _litellm_python(venv, args.litellm_version) if "litellm" in wanted else None

    from batchgen.limits.backend import get_redis
    from batchgen.store import db, tenants

    sim_args = ("--latency-base-ms", str(args.latency_ms), "--per-token-ms", str(args.per_token_ms))
    slots = 4 * max(levels)
    with simulator_process(*sim_args) as sim, servers() as workdir:
        env = live_model_env(workdir, MODEL, sim, slots)
        models_file = Path(env["BATCHGEN_MODELS_FILE"])
        extra = CLAUDE_TOML.format(name=CLAUDE, embed=EMBED, base_url=sim, concurrency=slots)
        models_file.write_text(models_file.read_text() + extra)
        with db.session_scope() as s:
            _, key = tenants.create_tenant(s, "caller")
        pg_pid = postgres_server_pid(os.environ["DATABASE_URL"])
        redis_pid = redis_server_pid(get_redis())
        with contextlib.ExitStack() as stack:
            sides: list[Side] = []
            if "provider" in wanted:
                sides.append(Side("provider", sim, "bench"))
            if python is not None:
                url, pid = stack.enter_context(litellm_proxy(python, sim, workdir))
                sides.append(Side("litellm", url, MASTER_KEY, {"proxy": pid}))
            if "batchgen" in wanted:
                url, pid = stack.enter_context(api_process(env, workdir / "api.log"))
                found = {"api": pid, "postgres": pg_pid, "redis": redis_pid}
                processes = {name: p for name, p in found.items() if p}
                sides.append(Side("batchgen", url, key, processes))
            for kind in kinds:
                for side in sides:
                    asyncio.run(_run(side, kind, args.warmup, 4, args.max_tokens))
            rows: list[dict[str, Any]] = []
            for kind in kinds:
                for conc in levels:
                    runs = {}
                    for side in sides:
                        runs[side.name] = asyncio.run(
                            _run(side, kind, args.requests, conc, args.max_tokens)
                        )
                    direct = runs.get("provider")
                    for name, run in runs.items():
                        row = _row(name, run, direct, kind.stream)
                        rows.append({"kind": kind.name, "conc": conc, **row})
                        if run.errors:
                            print(f"  {kind.name} c={conc} {name}: errors {run.errors}", flush=True)
    load = os.getloadavg()
    print(
        f"\n{args.requests} requests per row; simulator: {args.latency_ms:g} ms to the first "
        f"token, then {args.per_token_ms:g} ms per token, {args.max_tokens} tokens; "
        f"LiteLLM {args.litellm_version}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print_table(rows)
    print()
    for line in cpu_split(rows):
        print(line)
    print()
    lines = verdicts(rows)
    for line in lines:
        print(line)
    behind = sum("BEHIND" in line for line in lines)
    print(f"\nbatchgen ahead on {len(lines) - behind} of {len(lines)} figures")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
