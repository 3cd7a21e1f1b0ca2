"""Shared pieces of the benchmarks: real servers, a simulator process, workers.

Benchmarks run on embedded PostgreSQL and Redis (or the given URLs, in a
database of their own), a simulator in its own process, and real Celery
worker processes, and print ratios measured side by side in one run.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]

MODEL_TOML = """
[models."{name}"]
provider = "openai"
base_url = "{base_url}/v1"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "{name}"
budget_key = "{name}-account"
context_window = 16384
max_output_tokens = 400
tokens_per_min = {tpm}
requests_per_min = {rpm}
max_concurrency = {concurrency}
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
encoding = "cl100k_base"
charge_policy = "reserve"
max_attempts = 50
"""


@contextlib.contextmanager
def servers() -> Iterator[Path]:
    """Embedded (or given) PostgreSQL and Redis, a fresh database, migrated."""
    from batchgen import embedded
    from batchgen.config import get_settings
    from batchgen.store import db

    workdir = Path(tempfile.mkdtemp(prefix="batchgen-bench-"))
    with embedded.services(workdir / "data") as urls:
        name = f"batchgen_bench_{os.getpid()}"
        embedded.drop_database(urls["DATABASE_URL"], name)
        os.environ["DATABASE_URL"] = embedded.ensure_database(urls["DATABASE_URL"], name)
        get_settings.cache_clear()
        db.upgrade()
        try:
            yield workdir
        finally:
            db.get_engine().dispose()
            embedded.drop_database(urls["DATABASE_URL"], name)


@contextlib.contextmanager
def simulator_process(*args: str) -> Iterator[str]:
    """``python -m batchgen.simulator`` on a free port; yields its base URL."""
    from batchgen.embedded import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchgen.simulator",
            "--port",
            str(port),
            "--log-level",
            "WARNING",
            *args,
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{url}/_sim/stats", timeout=0.5).raise_for_status()
                break
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def reset_state(sim_url: str) -> None:
    """Empty tables, an empty Redis and a fresh simulator between runs.

    The previous run's calls are let finish first; TRUNCATE then takes its
    table locks (retried if a worker's transaction still holds one).
    """
    from sqlalchemy.exc import OperationalError

    from batchgen.limits.backend import get_redis
    from batchgen.store.db import get_engine

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with get_engine().connect() as conn:
            busy = conn.execute(
                text("SELECT count(*) FROM items WHERE status IN ('queued', 'running')")
            ).scalar()
        if not busy:
            break
        time.sleep(0.5)
    for attempt in range(10):
        try:
            with get_engine().begin() as conn:
                conn.execute(
                    text(
                        "TRUNCATE tenant_daily_usage, usage_ledger, results, items, "
                        "batches, tenants RESTART IDENTITY CASCADE"
                    )
                )
            break
        except OperationalError:
            if attempt == 9:
                raise
            time.sleep(0.5)
    get_redis().flushdb()
    httpx.post(f"{sim_url}/_sim/reset").raise_for_status()


def chat_requests(n: int, model: str, prefix: str, seed: int = 0) -> list[dict[str, Any]]:
    """Mixed prompt lengths (1-150 words) and max_tokens (20-200)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 150)))
        rows.append(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "max_tokens": rng.randint(20, 200),
                    "messages": [{"role": "user", "content": f"{prefix} {i}: {words}"}],
                },
            }
        )
    return rows


def wait_finished(batch_ids: list[str], timeout_s: float) -> None:
    from sqlalchemy import func, select

    from batchgen.store.db import session_scope
    from batchgen.store.schema import Batch

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with session_scope() as s:
            open_ = s.scalar(
                select(func.count())
                .select_from(Batch)
                .where(Batch.id.in_(batch_ids), Batch.finished_at.is_(None))
            )
        if not open_:
            return
        time.sleep(0.5)
    raise TimeoutError(f"batches not finished within {timeout_s}s")
