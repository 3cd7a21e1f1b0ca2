"""How fast a large batch is stored: over HTTP, through the Python API, and a raw
PostgreSQL COPY of the same item rows, side by side in one run.

Set-up: PostgreSQL and Redis (embedded, or the given ``DATABASE_URL`` / ``REDIS_URL``
in a database of their own) and ``batchgen api`` in its own process (Werkzeug's
server, as `batchgen api` runs it). One JSONL file of ``--lines`` chat requests is

  (a) POSTed to ``/v1/batches`` (the body streamed from the file);
  (b) submitted with ``batchgen.python_api.submit_batch`` (the file's lines);
  (c) the rows (b) stored, copied with ``COPY items (...) FROM STDIN`` into a fresh
      batch: the floor of any way of storing them.

Each prints its wall time and lines/s; the ratios are COPY's time over each. The API
process's peak RSS before and after its POST shows whether memory stays flat.

    .venv/bin/python bench/submission.py [--lines 50000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import chat_requests, servers

COLUMNS = (
    "batch_id, tenant_id, line_no, custom_id, model, priority_rank, body, prompt_tokens_est, "
    "max_tokens, status, deadline_at"
)


def _api(env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    from batchgen.embedded import free_port

    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 - the process keeps it
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgen.cli", "api", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("the API did not start")


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM) so far, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _copy(batch_id: str) -> float:
    """COPY the rows of ``batch_id`` into a new batch; returns the seconds it took."""
    import psycopg

    from batchgen.config import get_settings

    url = get_settings().sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            f"SELECT {COLUMNS} FROM items WHERE batch_id = %s", [batch_id]
        ).fetchall()
        copy_id = "batch_" + uuid.uuid4().hex
        conn.execute(
            "INSERT INTO batches (id, tenant_id, status, endpoint, priority, completion_window_s,"
            " deadline_at, total_items, offload) SELECT %s, tenant_id, status, endpoint,"
            " priority, completion_window_s, deadline_at, total_items, offload FROM batches"
            " WHERE id = %s",
            [copy_id, batch_id],
        )
        started = time.perf_counter()
        with conn.cursor().copy(f"COPY items ({COLUMNS}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row((copy_id, *row[1:6], json.dumps(row[6]), *row[7:]))
        conn.commit()
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=50_000)
    args = parser.parse_args()

    import httpx

    from batchgen import python_api
    from batchgen.config import get_settings
    from batchgen.store import db, tenants

    with servers() as workdir:
        env = {
            "DATABASE_URL": os.environ["DATABASE_URL"],
            "REDIS_URL": os.environ.get("REDIS_URL", get_settings().redis.url or ""),
            "CELERY_BROKER_URL": os.environ.get("CELERY_BROKER_URL", get_settings().broker_url),
            "BATCHGEN_MAX_BATCH_LINES": str(args.lines),
            "BATCHGEN_MAX_BODY_BYTES": str(1 << 30),
            "BATCHGEN_MAX_TOKENIZE_BYTES": str(1 << 30),
            "BATCHGEN_MAX_BACKLOG_MIN": "100000",
        }
        os.environ.update(env)
        get_settings.cache_clear()
        with db.session_scope() as s:
            _, key = tenants.create_tenant(s, "bulk")
        path = workdir / "requests.jsonl"
        with path.open("wb") as fh:
            for row in chat_requests(args.lines, "sim-small", "bench"):
                fh.write(json.dumps(row).encode() + b"\n")
        proc, url = _api(env, workdir / "api.log")
        try:
            rss_before_mb = _peak_rss_mb(proc.pid)
            started = time.perf_counter()
            with path.open("rb") as fh:
                answer = httpx.post(
                    f"{url}/v1/batches?priority=bulk",
                    content=fh,
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/jsonl"},
                    timeout=600,
                )
            http_s = time.perf_counter() - started
            assert answer.status_code == 200, answer.text[:500]
            rss_after_mb = _peak_rss_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(10)
        started = time.perf_counter()
        with path.open("rb") as fh:
            batch = python_api.submit_batch(fh, tenant="bulk", priority="bulk")
        python_s = time.perf_counter() - started
        copy_s = _copy(batch["id"])

    print(f"{args.lines} lines ({path.stat().st_size / 1e6:.1f} MB) stored as one batch")
    print(
        f"API process peak RSS: {rss_before_mb:.0f} MB before the POST, "
        f"{rss_after_mb:.0f} MB after it"
    )
    print(f"{'':22}{'seconds':>10}{'lines/s':>12}{'COPY / it':>12}")
    for label, seconds in (
        ("HTTP POST /v1/batches", http_s),
        ("python_api", python_s),
        ("raw COPY", copy_s),
    ):
        print(f"{label:22}{seconds:>10.2f}{args.lines / seconds:>12.0f}{copy_s / seconds:>12.3f}")


if __name__ == "__main__":
    main()
