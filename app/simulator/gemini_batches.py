"""Gemini Batch Mode, simulated (the Gemini API's ``batchGenerateContent`` with inline
requests, or a JSONL file uploaded to the Files API,
:mod:`batchgen.simulator.gemini_files`, whose job writes its results to a file), and
Vertex AI's batch prediction (``batchPredictionJobs``, its JSONL input read from and
its ``predictions.jsonl`` written to Cloud Storage at ``gcs_endpoint_url``:
gcp-storage-emulator in the tests): jobs created, read, listed
and cancelled as the ``google-genai`` SDK calls them, on the same clock, turnaround,
row errors, expiry, failure, enqueued-token limit and create delay as the other
batch APIs (:mod:`batchgen.simulator.batch_jobs`).

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
from urllib.parse import quote

import httpx
from aiohttp import web

from batchgen.simulator import batch_jobs, counting, gemini_files, native, rich
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


def _requests(request: web.Request, config: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's requests: inline (``requests.requests``, each with its ``metadata``),
    or the lines of an uploaded file (``fileName``: ``{"key", "request"}`` each, the key
    kept as ``metadata.key``)."""
    name = config.get("fileName")
    if name is None:
        return list(config["requests"]["requests"])
    data = gemini_files.read(request.app, str(name), _key(request))
    if data is None:
        raise KeyError("fileName")
    lines = [json.loads(raw) for raw in data.splitlines() if raw.strip()]
    return [{"request": line["request"], "metadata": {"key": line["key"]}} for line in lines]


def _rows(requests: list[dict[str, Any]], model: str, state: SimState) -> list[dict[str, Any]]:
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
        config = body["batch"]["inputConfig"]
        rows = _rows(_requests(request, config), model, state)
    except (ValueError, KeyError, TypeError, BadRequest):
        return _error(400, "invalid batch requests")
    state.last_request[API] = body
    job = batch_jobs._new_job(jobs, state, "gemini", _key(request), rows)
    del jobs.jobs[job.id]
    job.id = "batches/" + uuid.uuid4().hex[:20]
    jobs.jobs[job.id] = job
    job.metadata = {"displayName": body["batch"].get("displayName"), "file": "fileName" in config}
    if job.failed and job.failed_code == "token_limit_exceeded":
        job.failed_code = "429"
    await asyncio.sleep(state.config.batch_create_delay_s)
    return web.json_response(_operation(request.app, job))


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


def _results_file(app: web.Application, job: Job, responses: list[dict[str, Any]]) -> str:
    """The job's results file (written once): a line ``{"key", "response"}`` or
    ``{"key", "error"}`` per answered request."""
    meta = job.metadata or {}
    if "responsesFile" not in meta:
        lines = []
        for entry in responses:
            line = {"key": (entry.pop("metadata", None) or {}).get("key"), **entry}
            lines.append(json.dumps(line, separators=(",", ":")).encode())
        data = b"".join(line + b"\n" for line in lines)
        meta["responsesFile"] = gemini_files.write(app, job.key, data)
    return str(meta["responsesFile"])


def _operation(app: web.Application, job: Job) -> dict[str, Any]:
    jobs, state = app[JOBS], app[STATE]
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
    elif ended is not None and (job.metadata or {}).get("file"):
        metadata["output"] = {"responsesFile": _results_file(app, job, _outputs(jobs, state, job))}
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
    return web.json_response(_operation(request.app, job))


async def listing(request: web.Request) -> web.Response:
    """``batches``: the caller's jobs, newest first (``pageSize``, ``pageToken``)."""
    jobs = request.app[JOBS]
    key = _key(request)
    mine = sorted(
        (j for j in jobs.jobs.values() if j.api == "gemini" and j.key == key),
        key=lambda j: j.created_s,
        reverse=True,
    )
    start = int(request.query.get("pageToken") or 0)
    size = int(request.query.get("pageSize") or 50)
    page = mine[start : start + size]
    body: dict[str, Any] = {"operations": [_operation(request.app, j) for j in page]}
    if start + size < len(mine):
        body["nextPageToken"] = str(start + size)
    return web.json_response(body)


def add_routes(app: web.Application, prefix: str = "") -> None:
    add_vertex_routes(app)
    gemini_files.add_routes(app)
    app.router.add_get(prefix + "/{version}/batches", listing)
    app.router.add_get(prefix + "/{version}/batches/{call}", get)
    app.router.add_post(prefix + "/{version}/batches/{call}", get)


# --- Vertex AI: batch prediction ------------------------------------------------------

VERTEX_STATES = {
    "in_progress": "JOB_STATE_RUNNING",
    "completed": "JOB_STATE_SUCCEEDED",
    "cancelled": "JOB_STATE_CANCELLED",
    "expired": "JOB_STATE_EXPIRED",
    "failed": "JOB_STATE_FAILED",
}


def _gcs(state: SimState) -> str:
    return (state.config.gcs_endpoint_url or "https://storage.googleapis.com").rstrip("/")


def _gcs_read(state: SimState, uri: str) -> bytes:
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    url = f"{_gcs(state)}/storage/v1/b/{bucket}/o/{quote(name, safe='')}"
    answer = httpx.get(url, params={"alt": "media"}, timeout=30)
    answer.raise_for_status()
    return answer.content


def _gcs_write(state: SimState, uri: str, data: bytes) -> None:
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    url = f"{_gcs(state)}/upload/storage/v1/b/{bucket}/o"
    httpx.post(
        url, params={"uploadType": "media", "name": name}, content=data, timeout=30
    ).raise_for_status()


def _vertex_key(request: web.Request) -> str:
    """A project's jobs are the caller's (its access tokens change at every refresh)."""
    return "vertex:" + request.match_info["project"]


async def vertex_create(request: web.Request) -> web.Response:
    """``projects/{p}/locations/{l}/batchPredictionJobs`` (POST)."""
    jobs, state = request.app[JOBS], request.app[STATE]
    try:
        body = json.loads(await request.read())
        model = str(body["model"]).rsplit("/", 1)[-1]
        (uri,) = body["inputConfig"]["gcsSource"]["uris"]
        data = await asyncio.to_thread(_gcs_read, state, uri)
        rows = []
        for raw in data.splitlines():
            if not raw.strip():
                continue
            line = json.loads(raw)
            req = native.parse_gemini(line["request"], model, False, 1024)
            rows.append(
                {
                    "custom_id": json.dumps(line["request"].get("labels") or {}),
                    "metadata": None,
                    "line": line,
                    "model": model,
                    "messages": req.prompt_messages,
                    "max_tokens": req.max_tokens,
                    "chat": req.body,
                }
            )
    except (ValueError, KeyError, TypeError, BadRequest, httpx.HTTPError):
        return _error(400, "invalid batch prediction job")
    job = batch_jobs._new_job(jobs, state, "vertex", _vertex_key(request), rows)
    del jobs.jobs[job.id]
    where = f"projects/{request.match_info['project']}/locations/{request.match_info['location']}"
    job.id = f"{where}/batchPredictionJobs/{uuid.uuid4().int % 10**18}"
    job.metadata = {
        "displayName": body.get("displayName"),
        "model": body["model"],
        "inputConfig": body["inputConfig"],
        "outputConfig": body["outputConfig"],
    }
    jobs.jobs[job.id] = job
    await asyncio.sleep(state.config.batch_create_delay_s)
    return web.json_response(await _prediction_job(jobs, state, job))


async def _prediction_job(jobs: BatchJobs, state: SimState, job: Job) -> dict[str, Any]:
    assert job.metadata is not None
    status = jobs.status(job, state)
    ended = jobs.ended_s(job, state)
    prefix = job.metadata["outputConfig"]["gcsDestination"]["outputUriPrefix"].rstrip("/")
    directory = f"{prefix}/prediction-model-{int(job.created_s)}"
    if ended is not None and job.failed is None and job.output_file_id is None:
        lines = []
        for i, row in enumerate(job.rows):
            outcome = jobs.outcome(job, i, state)
            if outcome == "succeeded":
                lines.append({**row["line"], "status": "", "response": _answer(row, state)})
            elif outcome == "errored":
                lines.append({**row["line"], "status": "Internal error (simulated)."})
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        if data:  # a job stopped before any row answers writes no file
            await asyncio.to_thread(_gcs_write, state, f"{directory}/predictions.jsonl", data)
        job.output_file_id = directory
    body: dict[str, Any] = {
        "name": job.id,
        "displayName": job.metadata["displayName"],
        "model": job.metadata["model"],
        "state": VERTEX_STATES[status],
        "inputConfig": job.metadata["inputConfig"],
        "outputConfig": job.metadata["outputConfig"],
        "createTime": batch_jobs._rfc3339(job.created_s),
        "updateTime": batch_jobs._rfc3339(ended or time.time()),
    }
    if ended is not None:
        body["endTime"] = batch_jobs._rfc3339(ended)
        body["outputInfo"] = {"gcsOutputDirectory": directory}
    if job.failed is not None:
        body["error"] = {"code": 8, "message": job.failed}
    return body


async def vertex_job(request: web.Request) -> web.Response:
    """``.../batchPredictionJobs/{id}`` (GET) and ``...:cancel`` (POST)."""
    jobs, state = request.app[JOBS], request.app[STATE]
    ident, _, method = request.match_info["call"].partition(":")
    where = f"projects/{request.match_info['project']}/locations/{request.match_info['location']}"
    job = jobs.jobs.get(f"{where}/batchPredictionJobs/{ident}")
    if job is None or job.key != _vertex_key(request):
        return _error(404, "no such batch prediction job")
    if method == "cancel" and request.method == "POST":
        if jobs.ended_s(job, state) is None:
            job.cancelled_s = time.time()
        return web.json_response({})
    return web.json_response(await _prediction_job(jobs, state, job))


async def vertex_list(request: web.Request) -> web.Response:
    jobs, state = request.app[JOBS], request.app[STATE]
    key = _vertex_key(request)
    mine = sorted(
        (j for j in jobs.jobs.values() if j.api == "vertex" and j.key == key),
        key=lambda j: j.created_s,
        reverse=True,
    )
    size = int(request.query.get("pageSize") or 100)
    body = {"batchPredictionJobs": [await _prediction_job(jobs, state, j) for j in mine[:size]]}
    return web.json_response(body)


def add_vertex_routes(app: web.Application) -> None:
    where = "/{version}/projects/{project}/locations/{location}/batchPredictionJobs"
    app.router.add_post(where, vertex_create)
    app.router.add_get(where, vertex_list)
    app.router.add_get(where + "/{call}", vertex_job)
    app.router.add_post(where + "/{call}", vertex_job)
