"""A dollar budget under load: is it ever overspent, and how much of it is used?

In one run, on embedded PostgreSQL and Redis, a simulator process, a ``batchgen api``
process and two Celery worker processes, one tenant with a ``total`` budget of
``--budget-usd`` ($0.50) spends it two ways at once: ``--calls`` (64) concurrent
synchronous calls through ``POST /v1/chat/completions``, and a batch of ``--items``
(2 000) items, all with ``max_tokens`` ``--max-tokens``, enough for the whole lot to
cost more than the budget. Once no item is queued or running any more (the rest are
held, pending), the bench prints the ledger's total for the period, the overspend
(the ledger's total over the budget; target 0) and the fraction of the budget used
(target >= 0.95), with the calls answered and refused (429 ``budget_exhausted``).

LiteLLM's proxy, side by side: its per-key ``max_budget`` lives in its database
(virtual keys are rows that ``/key/generate`` writes through Prisma; without
``DATABASE_URL`` the proxy refuses to make a key). Prisma's Python client needs its
query engine, a binary that ``prisma generate`` downloads from Prisma's own servers at
first use, not from a package registry: this machine reaches package registries only,
so LiteLLM's key budgets cannot run here, and the bench says so rather than measure
LiteLLM without them (its proxy without a database has no key budget to overspend).

    .venv/bin/python bench/spend.py [--budget-usd 0.50] [--calls 64] [--items 2000]
        [--max-tokens 400] [--latency-ms 50] [--per-token-ms 0.5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (  # noqa: E402
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
TENANT = "spender"
LITELLM_WHY = (
    "LiteLLM's key max_budget: not run. Its virtual keys live in its database "
    "(/key/generate writes them through Prisma), and Prisma's client needs a query "
    "engine binary that it downloads from Prisma's servers at first use; this machine "
    "reaches package registries only, so LiteLLM's key budgets cannot run here."
)


def _call(api: str, key: str, i: int, max_tokens: int, out: Counter[str]) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Describe product {i} in two lines."}],
        "max_tokens": max_tokens,
    }
    try:
        answer = httpx.post(
            f"{api}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
    except httpx.HTTPError as exc:
        out[type(exc).__name__] += 1
        return
    if answer.status_code == 200:
        out["answered"] += 1
    else:
        code = (answer.json().get("error") or {}).get("code", "?")
        out[f"http {answer.status_code} {code}"] += 1


def _in_flight() -> int:
    from sqlalchemy import text

    from batchgen.store.db import session_scope

    with session_scope() as s:
        return int(
            s.scalar(text("SELECT count(*) FROM items WHERE status IN ('queued', 'running')")) or 0
        )


def _ledger_usd() -> Decimal:
    from sqlalchemy import text

    from batchgen.store.db import session_scope

    with session_scope() as s:
        return Decimal(s.scalar(text("SELECT coalesce(sum(cost_usd), 0) FROM usage_ledger")))


def _statuses() -> dict[str, int]:
    from sqlalchemy import text

    from batchgen.store.db import session_scope

    with session_scope() as s:
        rows = s.execute(text("SELECT status, count(*) FROM items GROUP BY status")).all()
    return {r[0]: int(r[1]) for r in rows}


def _settled(timeout_s: float) -> None:
    """Until nothing has been queued or running for 5 s (what is left is held)."""
    deadline, quiet_since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if _in_flight():
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= 5:
            return
        time.sleep(0.5)
    raise TimeoutError(f"items still in flight after {timeout_s:g} s")


def _git_head() -> str:
    root = Path(__file__).resolve().parent.parent
    found = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    )
    return found.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-usd", default="0.50")
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--per-token-ms", type=float, default=0.5)
    args = parser.parse_args()

    from batchgen import python_api, tenant_admin
    from batchgen.domain.billing import budget_maths as rules
    from batchgen.store import db, tenants
    from batchgen.worker import money_holds

    budget = Decimal(args.budget_usd)
    load = os.getloadavg()
    sim_args = ("--latency-base-ms", str(args.latency_ms), "--per-token-ms", str(args.per_token_ms))
    with simulator_process(*sim_args) as sim, servers() as workdir:
        env = live_model_env(workdir, MODEL, sim, CONCURRENCY, BATCHGEN_MONEY_HOLD_S="0.5")
        with db.session_scope() as s:
            _, key = tenants.create_tenant(s, TENANT)
        tenant_admin.set_budget(TENANT, limit_usd=str(budget), period="total")
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
                rows = chat_requests(args.items, MODEL, "spend")
                for row in rows:
                    row["body"]["max_tokens"] = args.max_tokens
                started = time.monotonic()
                python_api.submit_batch(rows, tenant=TENANT, priority="bulk")
                calls: Counter[str] = Counter()
                threads = [
                    threading.Thread(target=_call, args=(api, key, i, args.max_tokens, calls))
                    for i in range(args.calls)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                _settled(timeout_s=900)
                wall_s = time.monotonic() - started
                # A rebuild sets used to the ledger's exact spend (settles round each
                # row up), which may free room for a last item or two: until none runs.
                for _ in range(10):
                    before = _ledger_usd()
                    money_holds.sync_all()
                    _settled(timeout_s=120)
                    if _ledger_usd() == before:
                        break
                (state,) = tenant_admin.get_budgets(TENANT)
        finally:
            for w in workers:
                w.stop()
        spent = _ledger_usd()
        items = _statuses()
    over = max(Decimal(0), spent - budget)
    used = spent / budget
    print(
        f"commit {_git_head()}, load average at start {load[0]:.1f} {load[1]:.1f} "
        f"{load[2]:.1f}; {WORKERS} workers x {CONCURRENCY} threads; simulator "
        f"{args.latency_ms:g} ms + {args.per_token_ms:g} ms/token; max_tokens "
        f"{args.max_tokens}; {wall_s:.1f} s"
    )
    print(f"budget (total) ${budget}: {args.calls} concurrent calls + a batch of {args.items}")
    print(f"  calls:        {dict(sorted(calls.items()))}")
    print(f"  batch items:  {dict(sorted(items.items()))} (pending: held by the budget)")
    print(f"  ledger total: ${spent:.6f}")
    print(f"  overspend:    ${over:.6f}")
    print(f"  used:         {used:.4f} of the budget")
    print(
        f"  budget state: used ${rules.to_usd(state['used_micros'])}, "
        f"reserved ${rules.to_usd(state['reserved_micros'])}"
    )
    print(f"  {LITELLM_WHY}")


if __name__ == "__main__":
    main()
