"""Gemini Batch Mode, simulated (the Gemini API's ``batchGenerateContent`` with inline
requests): jobs created, read, listed and cancelled as the ``google-genai`` SDK calls
them, on the same clock, turnaround, row errors, expiry, failure, enqueued-token limit
and create delay as the other batch APIs (:mod:`batchgen.simulator.batch_jobs`).

A job is an operation ``batches/<id>`` whose ``metadata`` says its state
(``BATCH_STATE_RUNNING``, ``..._SUCCEEDED``, ``..._CANCELLED``, ``..._EXPIRED``,
``..._FAILED``) and, once it has ended, its ``output.inlinedResponses``: one entry per
request, in order, with the request's ``metadata``, a ``GenerateContentResponse`` as
``generateContent`` answers it online (tools included), or an ``error`` (a row that
failed, or one a cancel stopped). An expired job answers no request; a job over the
enqueued-token limit fails (``error.code`` 429).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from batchgen.simulator import batch_jobs, counting, native, rich
from batchgen.simulator import native_errors as errors
from batchgen.simulator.batch_jobs import JOBS, BatchJobs, Job
from batchgen.simulator.formats import BadRequest
from batchgen.simulator.state import STATE, SimState, key_id
from batchgen.simulator.text import completion_text

STATES = {
    "in_progress": "BATCH_STATE_RUNNING",
    "completed": "BATCH_STATE_SUCCEEDED",
    "cancelled": "BATCH_STATE_CANCELLED",
    "expired": "BATCH_STATE_EXPIRED",
    "failed": "BATCH_STATE_FAILED",
}
API = "gemini_batch"


def _key(request: web.Request) -> str:
    return key_id(request.headers.get("x-goog-api-key") or None)


def _error(status: int, message: str) -> web.Response:
    return web.json_response(errors.error_body(errors.GEMINI, status, message), status=status)


def _rows(body: Any, model: str, state: SimState) -> list[dict[str, Any]]:
    requests = body["batch"]["inputConfig"]["requests"]["requests"]
    rows = []
    for i, entry in enumerate(requests):
        req = native.parse_gemini(entry["request"], model, False, state.config.default_max_tokens)
        rows.append(
            {
                "custom_id": json.dumps(entry.get("metadata") or {"index": i}),
                "metadata": entry.get("metadata"),
                "model": model,
                "messages": req.prompt_messages,
                "max_tokens": req.max_tokens,
                "chat": req.body,
            }
        )
    return rows


async def create(request: web.Request, model: str) -> web.Response:
    """``models/{model}:batchGenerateContent``."""
    jobs, state = request.app[JOBS], request.app[STATE]
    try:
        body = json.loads(await request.read())
        rows = _rows(body, model, state)
    except (ValueError, KeyError, TypeError, BadRequest):
        return _error(400, "invalid batch requests")
    state.last_request[API] = body
    job = batch_jobs._new_job(jobs, state, "gemini", _key(request), rows)
    del jobs.jobs[job.id]
    job.id = "batches/" + uuid.uuid4().hex[:20]
    jobs.jobs[job.id] = job
    job.metadata = {"displayName": body["batch"].get("displayName")}
    if job.failed and job.failed_code == "token_limit_exceeded":
        job.failed_code = "429"
    await asyncio.sleep(state.config.batch_create_delay_s)
    return web.json_response(_operation(jobs, state, job))


def _answer(row: dict[str, Any], state: SimState) -> dict[str, Any]:
    encoding = state.config.encoding
    text, completion, finish = completion_text(row["messages"], row["max_tokens"], encoding)
    prompt = counting.prompt_tokens(errors.GEMINI, row["chat"], row["messages"], encoding)
    rid = "chatcmpl-" + uuid.uuid4().hex[:24]
    answer = rich.RichAnswer(
        "openai",
        row["chat"],
        rid,
        row["model"],
        (text, completion, finish),
        prompt,
        state.prompt_cache,
        encoding,
    )
    completion_body = answer.openai_completion(int(time.time()))
    return native.gemini_response(completion_body, rid, row["model"])


def _outputs(jobs: BatchJobs, state: SimState, job: Job) -> list[dict[str, Any]]:
    out = []
    for i, row in enumerate(job.rows):
        outcome = jobs.outcome(job, i, state)
        entry: dict[str, Any] = {"metadata": row["metadata"]} if row["metadata"] else {}
        if outcome == "succeeded":
            entry["response"] = _answer(row, state)
        elif outcome == "errored":
            entry["error"] = {"code": 500, "message": "Internal error (simulated)."}
        elif outcome == "cancelled":
            entry["error"] = {"code": 1, "message": "The request was cancelled."}
        else:
            continue  # an expired job answers none
        out.append(entry)
    return out


def _operation(jobs: BatchJobs, state: SimState, job: Job) -> dict[str, Any]:
    status = jobs.status(job, state)
    ended = jobs.ended_s(job, state)
    metadata: dict[str, Any] = {
        "@type": "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatch",
        "model": f"models/{job.rows[0]['model']}" if job.rows else None,
        "displayName": (job.metadata or {}).get("displayName"),
        "state": STATES[status],
        "createTime": batch_jobs._rfc3339(job.created_s),
        "updateTime": batch_jobs._rfc3339(ended or time.time()),
        "batchStats": {"requestCount": str(len(job.rows))},
    }
    operation: dict[str, Any] = {"name": job.id, "metadata": metadata, "done": ended is not None}
    if ended is not None:
        metadata["endTime"] = batch_jobs._rfc3339(ended)
    if job.failed is not None:
        code = int(job.failed_code) if job.failed_code.isdigit() else 400
        operation["error"] = {"code": code, "message": job.failed}
    elif ended is not None:
        responses = _outputs(jobs, state, job)
        metadata["output"] = {"inlinedResponses": {"inlinedResponses": responses}}
    return operation


def _find(request: web.Request, name: str) -> Job | None:
    job = request.app[JOBS].jobs.get(f"batches/{name}")
    return job if job is not None and job.key == _key(request) else None


async def get(request: web.Request) -> web.Response:
    """``batches/{name}`` and ``batches/{name}:cancel``."""
    name, _, method = request.match_info["call"].partition(":")
    job = _find(request, name)
    if job is None:
        return _error(404, "no such batch")
    jobs, state = request.app[JOBS], request.app[STATE]
    if method == "cancel" and request.method == "POST":
        if jobs.ended_s(job, state) is None:
            job.cancelled_s = time.time()
        return web.json_response({})
    if method:
        return _error(404, f"method {method!r} is not served")
    return web.json_response(_operation(jobs, state, job))


async def listing(request: web.Request) -> web.Response:
    """``batches``: the caller's jobs, newest first (``pageSize``, ``pageToken``)."""
    jobs, state = request.app[JOBS], request.app[STATE]
    key = _key(request)
    mine = sorted(
        (j for j in jobs.jobs.values() if j.api == "gemini" and j.key == key),
        key=lambda j: j.created_s,
        reverse=True,
    )
    start = int(request.query.get("pageToken") or 0)
    size = int(request.query.get("pageSize") or 50)
    page = mine[start : start + size]
    body: dict[str, Any] = {"operations": [_operation(jobs, state, j) for j in page]}
    if start + size < len(mine):
        body["nextPageToken"] = str(start + size)
    return web.json_response(body)


def add_routes(app: web.Application, prefix: str = "") -> None:
    app.router.add_get(prefix + "/{version}/batches", listing)
    app.router.add_get(prefix + "/{version}/batches/{call}", get)
    app.router.add_post(prefix + "/{version}/batches/{call}", get)
