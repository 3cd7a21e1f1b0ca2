"""bench/scale.py's files part, through ``batchgen api`` in its own process:

* a finished batch of ``--results`` succeeded items (a chat answer each): its output
  file's metadata (``GET /v1/files/{id}``, median of ``--repeat``) while its items are
  still in the totals' tail and once rolled up, and its download (``GET
  /v1/files/{id}/content``) in rows per second, next to the same rows rendered by
  Python one by one (``GET /v1/batches/{id}/results``, the way the output file was);
* a batch created from an upload of ``--upload-mb`` MB (``POST /v1/batches`` with its
  ``input_file_id``): the API process's peak RSS against its RSS when idle.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text

from bench import history
from bench.harness import api_process, chat_requests

# A chat completion as the simulator answers it, about 600 bytes of JSON.
ANSWER = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1767225600,
    "model": history.MODEL,
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "A sturdy oak table with a satin finish, seating six; the legs "
                "are turned by hand and the top is oiled twice. Delivered flat, it "
                "assembles in twenty minutes with the tools in the box.",
            },
            "finish_reason": "stop",
            "logprobs": None,
        }
    ],
    "usage": {"prompt_tokens": 58, "completion_tokens": 61, "total_tokens": 119},
    "system_fingerprint": "fp_bench",
}


@dataclass
class Files:
    results: int
    meta_tail_ms: float
    meta_ms: float
    download_rows_per_s: float
    download_mb: float
    python_rows_per_s: float


@dataclass
class Upload:
    file_mb: float
    lines: int
    idle_rss_mb: float
    peak_rss_mb: float
    create_s: float

    @property
    def bound_mb(self) -> float:
        return 1.5 * self.idle_rss_mb + 50


def _rss_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _finished_batch(tenant_id: int, n: int) -> str:
    """One finished batch of ``n`` succeeded items with their results, rendered-size
    realistic; returns its id."""
    from batchgen.store.db import get_engine

    batch_id = "batch_" + "f" * 32
    params = {"b": batch_id, "t": tenant_id, "n": n, "m": history.MODEL}
    with get_engine().begin() as conn:
        conn.execute(
            text(
                "INSERT INTO batches (id, tenant_id, status, endpoint, priority, "
                "completion_window_s, deadline_at, total_items, created_at, finished_at) "
                "VALUES (:b, :t, 'completed', '/v1/chat/completions', 'bulk', 86400, "
                "now() + interval '1 day', :n, now() - interval '2 hours', "
                "now() - interval '1 hour')"
            ),
            params,
        )
        conn.execute(
            text(
                "INSERT INTO items (batch_id, tenant_id, line_no, custom_id, model, "
                "priority_rank, body, prompt_tokens_est, max_tokens, status, attempts, "
                "deadline_at, created_at, started_at, finished_at) "
                "SELECT :b, :t, g, 'product-' || g, :m, 1, "
                '\'{"messages": [{"role": "user", "content": "Describe it."}]}\', '
                "60, 100, 'succeeded', 1, now() + interval '1 day', now() - interval '2 hours', "
                "now() - interval '90 minutes', now() - interval '1 hour' "
                "FROM generate_series(0, :n - 1) AS g"
            ),
            params,
        )
        conn.execute(
            text(
                "INSERT INTO results (item_id, batch_id, tenant_id, attempt, response, "
                "provider_request_id, prompt_tokens, completion_tokens, cost_usd, "
                "upstream_latency_ms, queue_wait_ms, created_at) "
                "SELECT id, batch_id, tenant_id, 1, "
                "jsonb_set(CAST(:answer AS jsonb), '{id}', to_jsonb('chatcmpl-' || id)), "
                "'req_' || id, 58, 61, 0.0001, 900, 3000, finished_at "
                "FROM items WHERE batch_id = :b"
            ),
            {**params, "answer": json.dumps(ANSWER)},
        )
    with get_engine().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE items"))
        conn.execute(text("VACUUM ANALYZE results"))
    return batch_id


def _env() -> dict[str, str]:
    import os

    from batchgen.config import get_settings

    settings = get_settings()
    return {
        "DATABASE_URL": os.environ["DATABASE_URL"],
        "REDIS_URL": os.environ.get("REDIS_URL", settings.redis.url or ""),
        "CELERY_BROKER_URL": os.environ.get("CELERY_BROKER_URL", settings.broker_url),
        "BATCHGEN_MAX_BATCH_LINES": str(10**7),
        "BATCHGEN_MAX_BODY_BYTES": str(1 << 30),
        "BATCHGEN_MAX_TOKENIZE_BYTES": str(1 << 30),
        "BATCHGEN_MAX_BACKLOG_MIN": "1000000",
    }


def _median_ms(run: object, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()  # type: ignore[operator]
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def _rows_per_s(client: object, url: str) -> tuple[float, float]:
    """Stream ``url``; rows (lines) per second and the MB read."""
    rows, size = 0, 0
    started = time.perf_counter()
    with client.stream("GET", url, timeout=600) as answer:  # type: ignore[attr-defined]
        assert answer.status_code == 200, answer.status_code
        for chunk in answer.iter_bytes():
            rows += chunk.count(b"\n")
            size += len(chunk)
    return rows / (time.perf_counter() - started), size / 1e6


def files(workdir: Path, results: int, repeat: int) -> Files:
    import httpx

    from batchgen.store import db, tenants, totals

    with db.session_scope() as session:
        tenant, key = tenants.create_tenant(session, "files-bench")
        tenant_id = tenant.id
    batch_id = _finished_batch(tenant_id, results)
    output_id = f"file-{batch_id}-output"
    with (
        api_process(_env(), workdir / "api-files.log") as (url, _),
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client,
    ):

        def meta() -> None:
            answer = client.get(f"/v1/files/{output_id}")
            assert answer.status_code == 200, answer.text

        meta()  # warm
        tail_ms = _median_ms(meta, max(1, repeat // 2))
        with db.session_scope() as session:
            totals.roll_up(session, lag_s=0)
        meta()
        meta_ms = _median_ms(meta, repeat)
        size = client.get(f"/v1/files/{output_id}").json()["bytes"]
        rows_s, mb = _rows_per_s(client, f"/v1/files/{output_id}/content")
        assert abs(mb * 1e6 - size) < 1, (mb, size)
        python_rows_s, _ = _rows_per_s(client, f"/v1/batches/{batch_id}/results")
    return Files(results, tail_ms, meta_ms, rows_s, mb, python_rows_s)


def upload(workdir: Path, upload_mb: float) -> Upload:
    import os

    import httpx

    from batchgen import python_api
    from batchgen.config import get_settings
    from batchgen.store import db, tenants

    os.environ.update(_env())  # the bounds of the API process, for the upload here
    get_settings.cache_clear()
    with db.session_scope() as session:
        _, key = tenants.create_tenant(session, "upload-bench")
    path = workdir / "upload.jsonl"
    lines = 0
    with path.open("wb") as fh:
        while fh.tell() < upload_mb * 1e6:
            for row in chat_requests(1000, history.MODEL, f"u{lines}"):
                fh.write(json.dumps(row).encode() + b"\n")
            lines += 1000
    stored = python_api.upload_file(path, tenant="upload-bench")
    with (
        api_process(_env(), workdir / "api-upload.log") as (url, pid),
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client,
    ):
        assert client.get("/v1/files").status_code == 200  # warm: a request served
        assert client.get(f"/v1/files/{stored['id']}").status_code == 200
        idle = _rss_mb(pid, "VmRSS")
        started = time.perf_counter()
        answer = client.post(
            "/v1/batches",
            json={
                "input_file_id": stored["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
            timeout=1800,
        )
        took = time.perf_counter() - started
        assert answer.status_code == 200, answer.text[:500]
        assert answer.json()["request_counts"]["total"] == lines
        peak = _rss_mb(pid, "VmHWM")
    return Upload(path.stat().st_size / 1e6, lines, idle, peak, took)
