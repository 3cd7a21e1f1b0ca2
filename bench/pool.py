"""One model over three deployments, one of them failing half its calls for a minute.

Side by side in one run, against one simulator process serving three simulated
deployments (``/d/<name>/``, each with its own sliding-window limits of tokens and
requests per window, 429 + retry-after beyond them; ``c`` answers half its calls
with a 5xx for the first ``--fault-s`` seconds):

  (a) batchgen: a model of three deployments, two worker processes; the gate picks
      a deployment with room in one script, failed calls fail over, a failing
      deployment cools down;
  (b) LiteLLM's Router on the same deployments (usage-based routing v2 on each
      deployment's tpm / rpm, cooldowns, 5 retries), 16 calls at a time, when
      ``litellm`` runs in the interpreter given by ``--litellm-python`` (a virtual
      environment of its own; the output says how to make one when there is none);
  (c) the same Router, the caller trying each failed item again every 5 s until
      it succeeds (what a batch job on the Router has to add: it queues nothing).

Each run gets fresh deployments (their windows empty, the fault's minute starting).
Printed per run: items succeeded / failed, items answered more than once, the
tokens delivered (admitted and answered) per whole window against the sum of the
healthy deployments' limits (a + b: what the pool has without the failing one) over
the fault's window and over the run, and per deployment the most tokens and
requests that reached it in any window (admitted or not: what the client sent)
against its limits, its 429s and 5xxs.

    .venv/bin/python bench/pool.py [--items 700] [--window-s 60] [--fault-s 60]
        [--litellm-python /tmp/litellm-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen.simulator.limits import max_window_sum
from bench.harness import reset_state, servers, simulator_process, wait_finished

HERE = Path(__file__).resolve().parent
MODEL = "pool"
# (name, tokens per window, requests per window, concurrency, flaky)
DEPLOYMENTS = [
    ("a", 60_000, 600, 8, False),
    ("b", 40_000, 400, 8, False),
    ("c", 20_000, 200, 8, True),
]
HEALTHY_TOKENS = sum(tpm for _, tpm, _, _, flaky in DEPLOYMENTS if not flaky)

POOL_TOML = """
[models."{model}"]
provider = "openai"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "{model}"
context_window = 16384
max_output_tokens = 1000
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
encoding = "cl100k_base"
charge_policy = "reserve"
max_attempts = 3
"""
DEPLOYMENT_TOML = """
[models."{model}".deployments.{name}]
base_url = "{base_url}/d/{name}/v1"
tokens_per_min = {tpm}
requests_per_min = {rpm}
max_concurrency = {concurrency}
"""


def requests(n: int, max_tokens: int) -> list[dict[str, Any]]:
    """``n`` prompts of about 120 tokens, each its own."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    rows = []
    for i in range(n):
        text = " ".join(words[(i + k) % len(words)] for k in range(110))
        rows.append(
            {
                "custom_id": f"item-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"Item {i}: {text}"}],
                },
            }
        )
    return rows


def lanes(fault_s: float) -> dict[str, dict[str, Any]]:
    """The simulated deployments (``POST /_sim/deployments``)."""
    fault = {"fault_rate": 0.5, "fault_kinds": ["5xx"], "fault_for_s": fault_s}
    return {
        name: {"tokens_per_min": tpm, "requests_per_min": rpm, **(fault if flaky else {})}
        for name, tpm, rpm, _, flaky in DEPLOYMENTS
    }


def set_deployments(sim_url: str, fault_s: float) -> None:
    """Fresh simulated deployments: empty windows, the fault's time starting now."""
    httpx.post(f"{sim_url}/_sim/deployments", json=lanes(fault_s)).raise_for_status()


def measure(sim_url: str, window_s: float, fault_s: float, elapsed_s: float) -> dict[str, Any]:
    """What the simulator saw of one run (its log and stats)."""
    log = httpx.get(f"{sim_url}/_sim/log", params={"limit": 1_000_000}).json()
    answered = [e for e in log if e["status"] == 200 and e["completed"] and e["admitted"]]
    per_item = Counter(e["item"] for e in answered)
    first = min((e["start_ts"] for e in answered), default=0.0)
    last = max((e["start_ts"] for e in answered), default=0.0)
    windows = int((last - first) // window_s)
    whole = sum(e["charged_tokens"] for e in answered if e["start_ts"] < first + windows * window_s)
    in_fault = sum(e["charged_tokens"] for e in answered if e["start_ts"] < first + fault_s)
    all_limits = sum(tpm for _, tpm, _, _, _ in DEPLOYMENTS)
    deployments = {}
    for name, tpm, rpm, _, _ in DEPLOYMENTS:
        reached = [e for e in log if e["deployment"] == name and e["requested_tokens"]]
        sent = [(e["start_ts"], e["requested_tokens"]) for e in reached]
        deployments[name] = {
            "calls": sum(1 for e in log if e["deployment"] == name),
            "answered": sum(1 for e in answered if e["deployment"] == name),
            "429s": sum(1 for e in log if e["deployment"] == name and e["status"] == 429),
            "5xx": sum(1 for e in log if e["deployment"] == name and (e["status"] or 0) >= 500),
            "max_tokens_sent": max_window_sum(sent, window_s),
            "max_requests_sent": max_window_sum([(e["start_ts"], 1) for e in reached], window_s),
            "tpm": tpm,
            "rpm": rpm,
        }
    return {
        "answered_twice": sum(1 for n in per_item.values() if n > 1),
        "delivered_in_fault": in_fault / (HEALTHY_TOKENS * fault_s / window_s),
        "delivered_whole": whole / (HEALTHY_TOKENS * windows) if windows else 0.0,
        "delivered_of_all": whole / (all_limits * windows) if windows else 0.0,
        "windows": windows,
        "elapsed_s": elapsed_s,
        "deployments": deployments,
    }


def run_batchgen(args: argparse.Namespace, sim_url: str, workdir: Path) -> dict[str, Any]:
    from batchgen import python_api as client
    from batchgen.config import get_settings
    from batchgen.store import db, tenants
    from batchgen.worker.procs import start_worker

    models_file = workdir / "models.toml"
    text = POOL_TOML.format(model=MODEL)
    for name, tpm, rpm, concurrency, _ in DEPLOYMENTS:
        text += DEPLOYMENT_TOML.format(
            model=MODEL, name=name, base_url=sim_url, tpm=tpm, rpm=rpm, concurrency=concurrency
        )
    models_file.write_text(text)
    env = {
        "BATCHGEN_MODELS_FILE": str(models_file),
        "BATCHGEN_BUDGET_WINDOW_S": str(args.window_s),
        "BATCHGEN_LOG_LEVEL": "WARNING",
    }
    os.environ.update(env)
    get_settings.cache_clear()
    reset_state(sim_url)
    with db.session_scope() as s:
        tenants.create_tenant(s, "bench-pool")
    workers = [
        start_worker(
            [f"llm.{MODEL}", "batchgen.control"],
            log_dir=workdir / "logs",
            concurrency=8,
            beat=i == 0,
            env=env,
            name=f"pool{i}",
        )
        for i in range(2)
    ]
    try:
        for w in workers:
            w.wait_ready()
        set_deployments(sim_url, args.fault_s)  # the fault's minute starts with the run
        started = time.monotonic()
        batch = client.submit_batch(
            requests(args.items, args.max_tokens), tenant="bench-pool", completion_window=3600
        )
        wait_finished([batch["id"]], timeout_s=args.timeout_s)
        elapsed = time.monotonic() - started
    finally:
        for w in workers:
            w.stop()
    counts = client.get_batch(batch["id"], tenant="bench-pool")["request_counts"]
    return {
        "succeeded": counts["succeeded"],
        "failed": counts["failed"],
        **measure(sim_url, args.window_s, args.fault_s, elapsed),
    }


def run_litellm(args: argparse.Namespace, sim_url: str, retry: bool) -> dict[str, Any] | str:
    """LiteLLM's Router in its own interpreter, or why it could not run."""
    python = args.litellm_python
    if not python or not Path(python).exists():
        return (
            "not run: no interpreter with litellm (make one: python3 -m venv /tmp/litellm-venv "
            "&& /tmp/litellm-venv/bin/pip install litellm; then --litellm-python "
            "/tmp/litellm-venv/bin/python)"
        )
    httpx.post(f"{sim_url}/_sim/reset").raise_for_status()
    set_deployments(sim_url, args.fault_s)  # before the Router's first call; again at its start
    scale = 60.0 / args.window_s  # LiteLLM counts per minute
    job = {
        "deployments": [
            {
                "name": name,
                "base_url": f"{sim_url}/d/{name}/v1",
                "tpm": int(tpm * scale),
                "rpm": int(rpm * scale),
            }
            for name, tpm, rpm, _, _ in DEPLOYMENTS
        ],
        "requests": [
            {"id": r["custom_id"], "messages": r["body"]["messages"], "max_tokens": args.max_tokens}
            for r in requests(args.items, args.max_tokens)
        ],
        "lanes_url": f"{sim_url}/_sim/deployments",
        "lanes": lanes(args.fault_s),
        "concurrency": 16,
        "num_retries": 5,
        "retry_for_s": args.timeout_s - 60 if retry else 0,
        "retry_wait_s": 5,
        "timeout_s": 30,
    }
    started = time.monotonic()
    done = subprocess.run(
        [python, str(HERE / "litellm_router.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=args.timeout_s,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        return f"failed to run (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, **measure(sim_url, args.window_s, args.fault_s, elapsed)}


def show(label: str, r: dict[str, Any] | str) -> None:
    if isinstance(r, str):
        print(f"\n{label}: {r}")
        return
    extra = f" (LiteLLM {r['litellm']}; errors {r['errors']})" if "litellm" in r else ""
    for kind, text in (r.get("first_error") or {}).items():
        extra += f"\n  first {kind}: {text}"
    print(f"\n{label}{extra}")
    print(
        f"  items succeeded {r['succeeded']}, failed {r['failed']}, answered twice "
        f"{r['answered_twice']}; {r['elapsed_s']:.0f} s, {r['windows']} whole windows"
    )
    print(
        f"  delivered / healthy limits (a + b): fault window {r['delivered_in_fault']:.3f}, "
        f"whole windows {r['delivered_whole']:.3f}; / all three limits, whole windows "
        f"{r['delivered_of_all']:.3f}"
    )
    if "caller_retries" in r:
        print(f"  the caller's own retries of failed items: {r['caller_retries']}")
    print(
        f"  {'deployment':10} {'calls':>6} {'ok':>6} {'429':>5} {'5xx':>5} "
        f"{'max tokens sent/limit':>22} {'max requests sent/limit':>24}"
    )
    for name, d in r["deployments"].items():
        tokens = f"{d['max_tokens_sent']}/{d['tpm']}"
        reqs = f"{d['max_requests_sent']}/{d['rpm']}"
        print(
            f"  {name:10} {d['calls']:6d} {d['answered']:6d} {d['429s']:5d} {d['5xx']:5d} "
            f"{tokens:>22} {reqs:>24}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=700)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--fault-s", type=float, default=60.0)
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--litellm-python", default="/tmp/litellm-venv/bin/python")
    args = parser.parse_args()

    with (
        servers() as workdir,
        simulator_process(
            "--window-s",
            str(args.window_s),
            "--latency-ms",
            "100",
            "--per-token-ms",
            "2",
            "--seed",
            "3",
        ) as sim_url,
    ):
        results = {
            "(a) batchgen, 3 deployments, 2 workers": run_batchgen(args, sim_url, workdir),
            "(b) LiteLLM Router, same deployments": run_litellm(args, sim_url, retry=False),
            "(c) LiteLLM Router, the caller retrying failed items every 5 s": run_litellm(
                args, sim_url, retry=True
            ),
        }
    print(
        f"\ndeployments (tokens/requests per {args.window_s:g} s window): "
        + ", ".join(
            f"{n} {t}/{r}"
            + (f" (5xx on half its calls for the first {args.fault_s:g} s)" if f else "")
            for n, t, r, _, f in DEPLOYMENTS
        )
        + f"; {args.items} items of ~120 prompt tokens, max_tokens {args.max_tokens}"
    )
    for label, r in results.items():
        show(label, r)


if __name__ == "__main__":
    main()
