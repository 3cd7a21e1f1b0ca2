"""LiteLLM's Router over the same simulated deployments, for bench/pool.py.

Run by a separate interpreter (a virtual environment with ``litellm``), so it imports
nothing of batchgen: it reads its job as JSON on stdin (the deployments' base URLs
and limits, the simulator's deployments to set just before it starts, the requests,
the concurrency) and prints one JSON line of results.
The Router is set up as its documentation recommends for several deployments of one
model: usage-based routing (v2) on each deployment's tpm / rpm, cooldowns after
failures, retries across deployments (no max_parallel_requests: the Router refuses a
call at once, with a RateLimitError, when a deployment has that many in flight).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import

import httpx  # noqa: E402
import litellm  # noqa: E402
from litellm import Router  # noqa: E402


async def main() -> None:
    job = json.load(sys.stdin)
    litellm.telemetry = False
    litellm.suppress_debug_info = True
    model_list = [
        {
            "model_name": "pool",
            "litellm_params": {
                "model": "openai/bench",
                "api_base": d["base_url"],
                "api_key": f"sk-{d['name']}",
                "tpm": d["tpm"],
                "rpm": d["rpm"],
            },
            "model_info": {"id": d["name"]},
        }
        for d in job["deployments"]
    ]
    router = Router(
        model_list=model_list,
        routing_strategy="usage-based-routing-v2",
        num_retries=job["num_retries"],
        allowed_fails=3,
        cooldown_time=5,
        retry_after=1,
        timeout=job["timeout_s"],
    )
    gate = asyncio.Semaphore(job["concurrency"])
    ok = failed = 0
    errors: dict[str, int] = {}
    first_error: dict[str, str] = {}

    retries = 0
    until = time.monotonic() + job["retry_for_s"]

    async def one(request: dict) -> None:
        # With retry_for_s, the caller tries a failed item again every retry_wait_s
        # (what a batch job on the Router would have to do), for that long at most.
        nonlocal ok, failed, retries
        while True:
            async with gate:
                try:
                    await router.acompletion(
                        model="pool",
                        messages=request["messages"],
                        max_tokens=request["max_tokens"],
                        extra_headers={"x-batchgen-item": request["id"]},
                    )
                    ok += 1
                    return
                except Exception as exc:  # noqa: BLE001 - counted by kind
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    first_error.setdefault(type(exc).__name__, str(exc)[:300])
            if time.monotonic() + job["retry_wait_s"] > until:
                failed += 1
                return
            retries += 1
            await asyncio.sleep(job["retry_wait_s"])

    # The simulated deployments afresh (empty windows, the fault's time starting now),
    # once the Router is built: its start-up is not the run's.
    httpx.post(job["lanes_url"], json=job["lanes"]).raise_for_status()
    started = time.monotonic()
    await asyncio.gather(*(one(r) for r in job["requests"]))
    print(
        json.dumps(
            {
                "succeeded": ok,
                "failed": failed,
                "caller_retries": retries,
                "errors": errors,
                "first_error": first_error,
                "elapsed_s": time.monotonic() - started,
                "litellm": getattr(litellm, "__version__", None)
                or __import__("importlib.metadata").metadata.version("litellm"),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
