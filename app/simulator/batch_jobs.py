"""The providers' own batch APIs, simulated: OpenAI Files + Batches and Anthropic's
Message Batches, with a turnaround, per-row errors, expiry, job failure and an
enqueued-token limit (runtime settings ``batch_*`` of :class:`SimulatorConfig`).

A job's state follows from the clock, read when it is asked for: it is ``in_progress``
from its creation until ``batch_turnaround_s`` have passed, then ends ``completed``
(``expired`` with ``batch_expire``), every row answered as the chat endpoint would
answer it (the same text, the same usage) except exactly the share
``batch_row_error_rate`` of rows (rounded; at seeded places), which fail (OpenAI: a 500
row in the error file; Anthropic: an ``errored`` result). An expired job answers no row:
they are ``batch_expired`` / ``expired``. Rows finish one after another over the
turnaround, so a cancelled job (it ends at once) keeps the rows it had finished; the
rest are ``batch_cancelled`` / ``canceled``. A job whose enqueued tokens (prompt +
max_tokens of its rows, beside the other open jobs of the same key and model) exceed
``batch_enqueued_tokens_limit`` fails at creation (OpenAI: ``failed`` with
``token_limit_exceeded``; Anthropic: a 429). ``batch_fail`` fails every new job.
``batch_create_delay_s`` answers a create that long after the job exists.

An OpenAI job holds requests to its ``endpoint``: ``/v1/chat/completions``,
``/v1/responses`` or ``/v1/embeddings`` (every line's ``url``; a line naming another
is a 400 at creation), each row answered as that endpoint answers online.

Self-contained like the rest of the simulator: no batchgen code but the token
counter. Nothing here logs a prompt or an answer.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from batchgen.domain.formats.tokens import count_messages
from batchgen.simulator import formats as fmt
from batchgen.simulator import rich
from batchgen.simulator import sim_endpoints as other
from batchgen.simulator.formats import BadRequest, ChatRequest
from batchgen.simulator.state import STATE, SimState, key_id
from batchgen.simulator.text import completion_text

CHAT_URL, RESPONSES_URL, EMBEDDINGS_URL = "/v1/chat/completions", "/v1/responses", "/v1/embeddings"

JOBS: web.AppKey[BatchJobs] = web.AppKey("batch_jobs")


@dataclass
class Job:
    id: str
    api: str  # "openai" or "anthropic"
    key: str
    created_s: float
    rows: list[dict[str, Any]]  # {custom_id, model, messages, max_tokens[, url, request]}
    metadata: dict[str, Any] | None = None
    input_file_id: str | None = None
    expire: bool = False
    failed: str | None = None  # why it failed at creation
    failed_code: str = "token_limit_exceeded"
    cancelled_s: float | None = None
    row_errors: set[int] = field(default_factory=set)
    enqueued_tokens: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    turnaround_s: float = 0.0  # the setting when it was created
    endpoint: str = CHAT_URL
    # Its chat rows' answers, made once (their cache reads are the job's, not the reads'):
    # row index -> the completion (OpenAI) or message (Anthropic).
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)


class BatchJobs:
    """Files and jobs of one simulator instance."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, str, bytes, float]] = {}  # id: (key, purpose, data, t)
        self.jobs: dict[str, Job] = {}

    def reset(self) -> None:
        self.files.clear()
        self.jobs.clear()

    def ended_s(self, job: Job, state: SimState | None = None) -> float | None:
        """When the job ended (None: still running)."""
        if job.failed is not None:
            return job.created_s
        if job.cancelled_s is not None:
            return job.cancelled_s
        end = job.created_s + job.turnaround_s
        return end if time.time() >= end else None

    def status(self, job: Job, state: SimState) -> str:
        if job.failed is not None:
            return "failed"
        if job.cancelled_s is not None:
            return "cancelled"
        if self.ended_s(job, state) is None:
            return "in_progress"
        return "expired" if job.expire else "completed"

    def outcome(self, job: Job, i: int, state: SimState) -> str:
        """Row ``i`` of an ended job: ``succeeded``, ``errored``, ``expired`` or
        ``cancelled``. Rows finish one after another over the turnaround (row ``i`` at
        ``(i + 1) / n`` of it), so a job cancelled midway keeps the rows it finished."""
        status = self.status(job, state)
        if status == "cancelled":
            done_s = job.created_s + job.turnaround_s * (i + 1) / len(job.rows)
            assert job.cancelled_s is not None
            if done_s > job.cancelled_s:
                return "cancelled"
        elif status != "completed":
            return "expired"
        return "errored" if i in job.row_errors else "succeeded"

    def counts(self, job: Job, state: SimState) -> dict[str, int]:
        """How many rows of an ended job end each way (nothing while it runs)."""
        counts = dict.fromkeys(("succeeded", "errored", "expired", "cancelled"), 0)
        if self.ended_s(job, state) is not None and job.failed is None:
            for i in range(len(job.rows)):
                counts[self.outcome(job, i, state)] += 1
        return counts

    def open_tokens(self, key: str, model: str, state: SimState) -> int:
        return sum(
            job.enqueued_tokens
            for job in self.jobs.values()
            if job.key == key
            and self.ended_s(job, state) is None
            and any(r["model"] == model for r in job.rows)
        )


def _rfc3339(epoch_s: float) -> str:
    moment = dt.datetime.fromtimestamp(epoch_s, dt.UTC).replace(microsecond=0)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _jobs(request: web.Request) -> tuple[BatchJobs, SimState]:
    return request.app[JOBS], request.app[STATE]


def _key(request: web.Request) -> str:
    auth = request.headers.get("authorization", "")
    token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    return key_id(token or request.headers.get("x-api-key"))


def _tokens(row: dict[str, Any], state: SimState) -> int:
    if row.get("url") == EMBEDDINGS_URL:
        return other.embeddings_prompt_tokens(row["request"].body, state.config.encoding)
    return count_messages(row["messages"], state.config.encoding) + row["max_tokens"]


def _answer(row: dict[str, Any], state: SimState) -> tuple[str, int, int, str]:
    text, completion, finish = completion_text(
        row["messages"], row["max_tokens"], state.config.encoding
    )
    return text, count_messages(row["messages"], state.config.encoding), completion, finish


def _new_job(
    jobs: BatchJobs, state: SimState, api: str, key: str, rows: list[dict[str, Any]], **kw: Any
) -> Job:
    prefix = "batch_" if api == "openai" else "msgbatch_"
    job = Job(prefix + uuid.uuid4().hex[:24], api, key, time.time(), rows, **kw)
    config = state.config
    job.expire = config.batch_expire
    job.turnaround_s = config.batch_turnaround_s
    # Exactly the share's rows (rounded), at seeded places: a test of a partly failed
    # job always has both kinds when the share and the rows allow it.
    rng = random.Random(f"{config.seed}:{job.id}")
    errored = round(config.batch_row_error_rate * len(rows))
    job.row_errors = set(rng.sample(range(len(rows)), errored))
    job.enqueued_tokens = sum(_tokens(r, state) for r in rows)
    limit = config.batch_enqueued_tokens_limit
    models = {r["model"] for r in rows}
    if config.batch_fail:
        job.failed, job.failed_code = "the job failed (simulated)", "batch_failed"
    elif limit and any(
        jobs.open_tokens(key, m, state) + job.enqueued_tokens > limit for m in models
    ):
        job.failed = f"enqueued token limit of {limit} reached"
    jobs.jobs[job.id] = job
    return job


def _find(request: web.Request, api: str) -> Job:
    jobs, _ = _jobs(request)
    job = jobs.jobs.get(request.match_info["job_id"])
    if job is None or job.api != api or job.key != _key(request):
        raise web.HTTPNotFound(
            text=json.dumps(fmt.error_body(api, 404, "no such batch")),
            content_type="application/json",
        )
    return job


# --- OpenAI: Files and Batches ------------------------------------------------------


async def _upload(request: web.Request) -> web.Response:
    jobs, _ = _jobs(request)
    form = await request.post()
    upload = form.get("file")
    if not isinstance(upload, web.FileField):
        return web.json_response(fmt.error_body("openai", 400, "file is required"), status=400)
    data = upload.file.read()
    file_id = "file-" + uuid.uuid4().hex[:24]
    purpose = str(form.get("purpose", "batch"))
    jobs.files[file_id] = (_key(request), purpose, data, time.time())
    return web.json_response(_file_object(file_id, purpose, data, upload.filename))


def _file_object(file_id: str, purpose: str, data: bytes, name: str) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": len(data),
        "created_at": int(time.time()),
        "filename": name,
        "purpose": purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


async def _file_content(request: web.Request) -> web.Response:
    jobs, state = _jobs(request)
    file_id = request.match_info["file_id"]
    stored = jobs.files.get(file_id)
    if stored is None or stored[0] != _key(request):
        return web.json_response(fmt.error_body("openai", 404, "no such file"), status=404)
    return web.Response(body=stored[2], content_type="application/octet-stream")


def _other_row(line: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    """A Responses or embeddings row: parsed as the endpoint parses it online."""
    body, url = line["body"], line["url"]
    if url == RESPONSES_URL:
        request = other.parse_responses(body, default_max_tokens)
    else:
        request = other.parse_embeddings(body)
    return {
        "custom_id": line["custom_id"],
        "model": request.model,
        "messages": request.prompt_messages,
        "max_tokens": request.max_tokens,
        "url": url,
        "request": request,
    }


def _openai_rows(data: bytes, endpoint: str, default_max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for raw in data.splitlines():
        if not raw.strip():
            continue
        line = json.loads(raw)
        if line.get("url", CHAT_URL) != endpoint:
            raise BadRequest(f"a line's url is not the batch's endpoint {endpoint}", "url")
        if endpoint != CHAT_URL:
            rows.append(_other_row(line, default_max_tokens))
            continue
        body = line["body"]
        rows.append(
            {
                "custom_id": line["custom_id"],
                "model": body["model"],
                "body": body,
                "messages": body["messages"],
                "max_tokens": int(
                    body.get("max_tokens") or body.get("max_completion_tokens") or 256
                ),
            }
        )
    return rows


async def _openai_create(request: web.Request) -> web.Response:
    jobs, state = _jobs(request)
    body = await request.json()
    stored = jobs.files.get(str(body.get("input_file_id")))
    if stored is None or stored[0] != _key(request):
        return web.json_response(fmt.error_body("openai", 404, "no such file"), status=404)
    endpoint = body.get("endpoint", CHAT_URL)
    if endpoint not in (CHAT_URL, RESPONSES_URL, EMBEDDINGS_URL):
        return web.json_response(fmt.error_body("openai", 400, "invalid endpoint"), status=400)
    try:
        rows = _openai_rows(stored[2], endpoint, state.config.default_max_tokens)
    except (ValueError, KeyError, TypeError, BadRequest):
        return web.json_response(fmt.error_body("openai", 400, "invalid input file"), status=400)
    job = _new_job(
        jobs,
        state,
        "openai",
        _key(request),
        rows,
        metadata=body.get("metadata"),
        input_file_id=body["input_file_id"],
        endpoint=endpoint,
    )
    await asyncio.sleep(state.config.batch_create_delay_s)
    return web.json_response(_openai_batch(jobs, state, job))


def _openai_batch(jobs: BatchJobs, state: SimState, job: Job) -> dict[str, Any]:
    status = jobs.status(job, state)
    ended = jobs.ended_s(job, state)
    if ended is not None and job.failed is None and job.output_file_id is None:
        _write_openai_files(jobs, state, job)
    done = status in ("completed", "cancelled", "expired")
    counts = jobs.counts(job, state)
    answered, failed_rows = counts["succeeded"], counts["errored"]
    at = int(ended) if ended is not None else None
    return {
        "id": job.id,
        "object": "batch",
        "endpoint": job.endpoint,
        "errors": (
            {"object": "list", "data": [{"code": job.failed_code, "message": job.failed}]}
            if job.failed
            else None
        ),
        "input_file_id": job.input_file_id,
        "completion_window": "24h",
        "status": status,
        "output_file_id": job.output_file_id if done else None,
        "error_file_id": job.error_file_id if done else None,
        "created_at": int(job.created_s),
        "in_progress_at": int(job.created_s) if job.failed is None else None,
        "expires_at": int(job.created_s + 86400),
        "finalizing_at": at if status == "completed" else None,
        "completed_at": at if status == "completed" else None,
        "failed_at": at if status == "failed" else None,
        "expired_at": at if status == "expired" else None,
        "cancelling_at": int(job.cancelled_s) if job.cancelled_s else None,
        "cancelled_at": at if status == "cancelled" else None,
        "request_counts": {"total": len(job.rows), "completed": answered, "failed": failed_rows},
        "metadata": job.metadata,
    }


def _chat_answer(job: Job, i: int, state: SimState) -> dict[str, Any]:
    """Chat row ``i``'s answer (an OpenAI completion or an Anthropic message), as the
    endpoint answers it online, its prompt cache included: a prefix warm in the key's
    cache is read from it (OpenAI's repeated prefix, Anthropic's breakpoint), else
    written (Anthropic), so a job's rows sharing a prefix after the first read it, and
    the Batch API's discount stacks with the cache's as the providers price it. Made
    once per row."""
    if i in job.answers:
        return job.answers[i]
    row = job.rows[i]
    text, prompt, completion, finish = _answer(row, state)
    body = row.get("body")
    rid = fmt.new_id(job.api)
    if body is None:  # a row made before its body was kept
        if job.api == "anthropic":
            answer = fmt.anthropic_message(rid, row["model"], text, finish, prompt, completion)
        else:
            answer = fmt.openai_completion(rid, row["model"], text, finish, prompt, completion)
    else:
        scope = (job.key, row["model"])
        encoding = state.config.encoding
        cached = (
            rich.openai_cached_tokens(state.prompt_cache, scope, body, encoding)
            if job.api == "openai"
            else 0
        )
        built = rich.RichAnswer(
            job.api,
            body,
            rid,
            row["model"],
            (text, completion, finish),
            prompt,
            state.prompt_cache,
            encoding,
            cached,
            scope,
        )
        if job.api == "anthropic":
            answer = built.anthropic_message()
        else:
            answer = built.openai_completion(int(time.time()))
    job.answers[i] = answer
    return answer


def _row_answer(job: Job, i: int, state: SimState) -> dict[str, Any]:
    """A row's answer, as its endpoint answers online."""
    row = job.rows[i]
    encoding = state.config.encoding
    request: ChatRequest | None = row.get("request")
    if request is None:
        return _chat_answer(job, i, state)
    if row["url"] == EMBEDDINGS_URL:
        return other.embedding_list(request, other.embeddings_prompt_tokens(request.body, encoding))
    answer = completion_text(request.prompt_messages, request.max_tokens, encoding)
    prompt = other.responses_prompt_tokens(request.body, request.prompt_messages, encoding)
    return other.response_object(other.new_response_id(), request, answer, prompt, 0)


def _write_openai_files(jobs: BatchJobs, state: SimState, job: Job) -> None:
    out, err = [], []
    for i, row in enumerate(job.rows):
        rid = fmt.new_id("openai")
        base = {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": row["custom_id"]}
        outcome = jobs.outcome(job, i, state)
        if outcome in ("expired", "cancelled"):
            code = "batch_expired" if outcome == "expired" else "batch_cancelled"
            err.append({**base, "response": None, "error": {"code": code, "message": code}})
        elif outcome == "errored":
            body = fmt.error_body("openai", 500, "the server had an error processing the row")
            err.append(
                {
                    **base,
                    "response": {"status_code": 500, "request_id": rid, "body": body},
                    "error": None,
                }
            )
        else:
            completion_body = _row_answer(job, i, state)
            out.append(
                {
                    **base,
                    "response": {"status_code": 200, "request_id": rid, "body": completion_body},
                    "error": None,
                }
            )
    for rows, attr in ((out, "output_file_id"), (err, "error_file_id")):
        if rows:
            file_id = "file-" + uuid.uuid4().hex[:24]
            data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
            jobs.files[file_id] = (job.key, "batch_output", data, time.time())
            setattr(job, attr, file_id)


async def _openai_get(request: web.Request) -> web.Response:
    jobs, state = _jobs(request)
    return web.json_response(_openai_batch(jobs, state, _find(request, "openai")))


async def _openai_cancel(request: web.Request) -> web.Response:
    jobs, state = _jobs(request)
    job = _find(request, "openai")
    if jobs.ended_s(job, state) is None:
        job.cancelled_s = time.time()
    return web.json_response(_openai_batch(jobs, state, job))


def _page(request: web.Request, api: str, after_param: str) -> tuple[list[Job], bool]:
    """One page of the caller's jobs of ``api``, newest first, after a cursor."""
    jobs, _ = _jobs(request)
    key = _key(request)
    mine = sorted(
        (j for j in jobs.jobs.values() if j.api == api and j.key == key),
        key=lambda j: j.created_s,
        reverse=True,
    )
    after = request.query.get(after_param)
    if after:
        ids = [j.id for j in mine]
        mine = mine[ids.index(after) + 1 :] if after in ids else []
    limit = int(request.query.get("limit", 20))
    return mine[:limit], len(mine) > limit


def _list_body(page: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "data": page,
        "has_more": has_more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


async def _openai_list(request: web.Request) -> web.Response:
    jobs, state = _jobs(request)
    page, more = _page(request, "openai", "after")
    body = _list_body([_openai_batch(jobs, state, j) for j in page], more)
    return web.json_response({"object": "list", **body})


# --- Anthropic: Message Batches -----------------------------------------------------


def _anthropic_rows(body: Any) -> list[dict[str, Any]]:
    rows = []
    for request in body["requests"]:
        params = request["params"]
        messages = list(params["messages"])
        if params.get("system"):
            messages = [{"role": "system", "content": params["system"]}, *messages]
        rows.append(
            {
                "custom_id": request["custom_id"],
                "model": params["model"],
                "body": params,
                "messages": messages,
                "max_tokens": int(params["max_tokens"]),
            }
        )
    return rows


async def _anthropic_create(request: web.Request) -> web.Response:
    jobs, state = _jobs(request)
    try:
        body = await request.json()
        rows = _anthropic_rows(body)
        state.last_request["anthropic_batch"] = body  # GET /_sim/last_request
    except (ValueError, KeyError, TypeError):
        return web.json_response(fmt.error_body("anthropic", 400, "invalid requests"), status=400)
    job = _new_job(jobs, state, "anthropic", _key(request), rows)
    if job.failed:
        del jobs.jobs[job.id]
        return web.json_response(fmt.error_body("anthropic", 429, job.failed), status=429)
    await asyncio.sleep(state.config.batch_create_delay_s)
    return web.json_response(_anthropic_batch(jobs, state, job, request))


def _anthropic_batch(
    jobs: BatchJobs, state: SimState, job: Job, request: web.Request
) -> dict[str, Any]:
    ended = jobs.ended_s(job, state)
    n = len(job.rows)
    counts = {"processing": n, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    if ended is not None:
        ours = jobs.counts(job, state)
        counts.update(ours, processing=0, canceled=ours["cancelled"])
        del counts["cancelled"]
    url = str(request.url.with_path(f"/v1/messages/batches/{job.id}/results").with_query(None))
    processing = (
        "ended" if ended is not None else ("canceling" if job.cancelled_s else "in_progress")
    )
    return {
        "id": job.id,
        "type": "message_batch",
        "processing_status": processing,
        "request_counts": counts,
        "created_at": _rfc3339(job.created_s),
        "expires_at": _rfc3339(job.created_s + 86400),
        "ended_at": _rfc3339(ended) if ended is not None else None,
        "cancel_initiated_at": _rfc3339(job.cancelled_s) if job.cancelled_s else None,
        "archived_at": None,
        "results_url": url if ended is not None else None,
    }


async def _anthropic_get(request: web.Request) -> web.Response:
    jobs, state = _jobs(request)
    return web.json_response(_anthropic_batch(jobs, state, _find(request, "anthropic"), request))


async def _anthropic_cancel(request: web.Request) -> web.Response:
    jobs, state = _jobs(request)
    job = _find(request, "anthropic")
    if jobs.ended_s(job, state) is None:
        job.cancelled_s = time.time()
    return web.json_response(_anthropic_batch(jobs, state, job, request))


async def _anthropic_results(request: web.Request) -> web.Response:
    jobs, state = _jobs(request)
    job = _find(request, "anthropic")
    if jobs.ended_s(job, state) is None:
        return web.json_response(
            fmt.error_body("anthropic", 400, "the batch is still processing"), status=400
        )
    lines = []
    for i, row in enumerate(job.rows):
        outcome = jobs.outcome(job, i, state)
        if outcome in ("expired", "cancelled"):
            result: dict[str, Any] = {"type": "expired" if outcome == "expired" else "canceled"}
        elif outcome == "errored":
            result = {"type": "errored", "error": fmt.error_body("anthropic", 500, "overloaded")}
        else:
            result = {"type": "succeeded", "message": _chat_answer(job, i, state)}
        lines.append(json.dumps({"custom_id": row["custom_id"], "result": result}).encode())
    return web.Response(body=b"\n".join(lines) + b"\n", content_type="application/binary")


async def _anthropic_list(request: web.Request) -> web.Response:
    jobs, state = _jobs(request)
    page, more = _page(request, "anthropic", "after_id")
    return web.json_response(
        _list_body([_anthropic_batch(jobs, state, j, request) for j in page], more)
    )


def add_batch_routes(app: web.Application) -> None:
    app[JOBS] = BatchJobs()
    app.router.add_post("/v1/files", _upload)
    app.router.add_get("/v1/files/{file_id}/content", _file_content)
    app.router.add_post("/v1/batches", _openai_create)
    app.router.add_get("/v1/batches", _openai_list)
    app.router.add_get("/v1/batches/{job_id}", _openai_get)
    app.router.add_post("/v1/batches/{job_id}/cancel", _openai_cancel)
    app.router.add_post("/v1/messages/batches", _anthropic_create)
    app.router.add_get("/v1/messages/batches", _anthropic_list)
    app.router.add_get("/v1/messages/batches/{job_id}", _anthropic_get)
    app.router.add_post("/v1/messages/batches/{job_id}/cancel", _anthropic_cancel)
    app.router.add_get("/v1/messages/batches/{job_id}/results", _anthropic_results)
