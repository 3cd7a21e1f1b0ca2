"""Bedrock batch inference, simulated: the control plane's model invocation jobs
(``CreateModelInvocationJob``, ``GetModelInvocationJob``, ``ListModelInvocationJobs``,
``StopModelInvocationJob``) as ``boto3``'s ``bedrock`` client calls them, reading each
job's JSONL input from S3 and writing its output there (a real S3-compatible server at
``s3_endpoint_url``: moto's in the tests), on the clock, row errors, expiry, failure,
enqueued-token limit and create delay of the other batch APIs
(:mod:`batchgen.simulator.batch_jobs`).

A record's ``modelInput`` is Anthropic Claude's InvokeModel body; its ``modelOutput``
the ``Message`` the Messages API would answer (tools and thinking included). A job of
fewer than ``batch_min_records`` records is refused (``ValidationException``), as
Bedrock refuses one under its minimum. The create is idempotent by its
``clientRequestToken``. Output: ``<output s3Uri>/<job id>/input.jsonl.out`` with
``{"recordId", "modelInput", "modelOutput"}`` or ``{..., "error"}``, written when the
job is first seen ended; a stopped or expired job's unprocessed records are absent.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from typing import Any

import boto3
import botocore.config
from aiohttp import web

from batchgen.simulator import batch_jobs, counting, rich
from batchgen.simulator import formats as fmt
from batchgen.simulator import native_errors as errors
from batchgen.simulator.batch_jobs import JOBS, BatchJobs, Job
from batchgen.simulator.formats import BadRequest
from batchgen.simulator.state import STATE, SimState, key_id
from batchgen.simulator.text import completion_text

ACCOUNT = "123456789012"
STATUSES = {
    "in_progress": "InProgress",
    "completed": "Completed",
    "cancelled": "Stopped",
    "expired": "Expired",
    "failed": "Failed",
}
_ACCESS_KEY = re.compile(r"Credential=([^/,\s]+)/")


def _key(request: web.Request) -> str:
    """The caller's access key id (from its SigV4 authorization), as the simulator's key."""
    found = _ACCESS_KEY.search(request.headers.get("authorization", ""))
    return key_id(found.group(1) if found else None)


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    body = errors.error_body(errors.BEDROCK, status, message, code)
    return web.json_response(
        body, status=status, headers=errors.error_headers(errors.BEDROCK, body)
    )


def _s3(state: SimState) -> Any:
    return boto3.session.Session().client(
        "s3",
        region_name="us-east-1",
        endpoint_url=state.config.s3_endpoint_url,
        aws_access_key_id="simulator",
        aws_secret_access_key="simulator",
        config=botocore.config.Config(s3={"addressing_style": "path"}),
    )


def _location(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def _read_input(state: SimState, uri: str) -> bytes:
    bucket, key = _location(uri)
    data: bytes = _s3(state).get_object(Bucket=bucket, Key=key)["Body"].read()
    return data


def _rows(data: bytes, model: str) -> list[dict[str, Any]]:
    rows = []
    for raw in data.splitlines():
        if not raw.strip():
            continue
        record = json.loads(raw)
        model_input = record["modelInput"]
        req = fmt.parse_anthropic({**model_input, "model": model})
        rows.append(
            {
                "custom_id": record["recordId"],
                "model": model,
                "messages": req.prompt_messages,
                "max_tokens": req.max_tokens,
                "input": model_input,
            }
        )
    return rows


def _arn(job: Job) -> str:
    return f"arn:aws:bedrock:us-east-1:{ACCOUNT}:model-invocation-job/{job.id}"


async def create(request: web.Request) -> web.Response:
    """``POST /model-invocation-job``."""
    jobs, state = request.app[JOBS], request.app[STATE]
    key = _key(request)
    try:
        body = await request.json()
        token = body.get("clientRequestToken")
        for job in jobs.jobs.values():
            ours = job.api == "bedrock" and job.key == key and token and job.metadata
            if ours and (job.metadata or {}).get("clientRequestToken") == token:
                return web.json_response({"jobArn": _arn(job)})
        uri = body["inputDataConfig"]["s3InputDataConfig"]["s3Uri"]
        data = await asyncio.to_thread(_read_input, state, uri)
        rows = _rows(data, str(body["modelId"]))
    except (ValueError, KeyError, TypeError, BadRequest):
        return _error(400, "The input file or the job's configuration is not valid.")
    except Exception:  # the input file could not be read from S3
        return _error(400, "The input file could not be read.", "ValidationException")
    if len(rows) < state.config.batch_min_records:
        return _error(
            400,
            f"The job has {len(rows)} records; the minimum is {state.config.batch_min_records}.",
        )
    state.last_request["bedrock_batch"] = body
    job = batch_jobs._new_job(jobs, state, "bedrock", key, rows)
    del jobs.jobs[job.id]
    job.id = secrets.token_hex(6)
    job.metadata = {
        "jobName": body["jobName"],
        "clientRequestToken": token,
        "modelId": body["modelId"],
        "roleArn": body["roleArn"],
        "inputDataConfig": body["inputDataConfig"],
        "outputDataConfig": body["outputDataConfig"],
    }
    jobs.jobs[job.id] = job
    await asyncio.sleep(state.config.batch_create_delay_s)
    return web.json_response({"jobArn": _arn(job)})


def _answer(row: dict[str, Any], state: SimState) -> dict[str, Any]:
    encoding = state.config.encoding
    body = {**row["input"], "model": row["model"]}
    text, completion, finish = completion_text(row["messages"], row["max_tokens"], encoding)
    prompt = counting.prompt_tokens("anthropic", body, row["messages"], encoding)
    answer = rich.RichAnswer(
        "anthropic",
        body,
        fmt.new_id("anthropic"),
        row["model"],
        (text, completion, finish),
        prompt,
        state.prompt_cache,
        encoding,
    )
    if rich.wants_rich("anthropic", body, row["model"]):
        return answer.anthropic_message()
    return fmt.anthropic_message(answer.rid, row["model"], text, finish, prompt, completion)


def _write_output(jobs: BatchJobs, state: SimState, job: Job) -> None:
    """The job's output records, once, to S3 (blocking: run in a thread)."""
    assert job.metadata is not None
    lines = []
    for i, row in enumerate(job.rows):
        outcome = jobs.outcome(job, i, state)
        record: dict[str, Any] = {"recordId": row["custom_id"], "modelInput": row["input"]}
        if outcome == "succeeded":
            record["modelOutput"] = _answer(row, state)
        elif outcome == "errored":
            record["error"] = {"errorCode": 500, "errorMessage": "Internal error (simulated)."}
        else:
            continue
        lines.append(json.dumps(record).encode())
    uri = job.metadata["outputDataConfig"]["s3OutputDataConfig"]["s3Uri"]
    bucket, prefix = _location(uri)
    folder = f"{prefix.rstrip('/')}/{job.id}".lstrip("/")
    client = _s3(state)
    client.put_object(Bucket=bucket, Key=f"{folder}/input.jsonl.out", Body=b"\n".join(lines))
    counts = jobs.counts(job, state)
    manifest = {
        "totalRecordCount": len(job.rows),
        "processedRecordCount": counts["succeeded"] + counts["errored"],
        "successRecordCount": counts["succeeded"],
        "errorRecordCount": counts["errored"],
    }
    client.put_object(
        Bucket=bucket, Key=f"{folder}/manifest.json.out", Body=json.dumps(manifest).encode()
    )


async def _job_body(jobs: BatchJobs, state: SimState, job: Job) -> dict[str, Any]:
    assert job.metadata is not None
    status = jobs.status(job, state)
    ended = jobs.ended_s(job, state)
    if ended is not None and job.failed is None and job.output_file_id is None:
        await asyncio.to_thread(_write_output, jobs, state, job)
        job.output_file_id = "written"
    counts = jobs.counts(job, state)
    named = STATUSES[status]
    if named == "Completed" and counts["errored"]:
        named = "PartiallyCompleted"
    body: dict[str, Any] = {
        "jobArn": _arn(job),
        "jobName": job.metadata["jobName"],
        "modelId": job.metadata["modelId"],
        "roleArn": job.metadata["roleArn"],
        "clientRequestToken": job.metadata.get("clientRequestToken"),
        "status": "Stopping" if job.cancelled_s and ended is None else named,
        "submitTime": batch_jobs._rfc3339(job.created_s),
        "lastModifiedTime": batch_jobs._rfc3339(ended or time.time()),
        "inputDataConfig": job.metadata["inputDataConfig"],
        "outputDataConfig": job.metadata["outputDataConfig"],
        "totalRecordCount": len(job.rows),
        "processedRecordCount": counts["succeeded"] + counts["errored"],
        "successRecordCount": counts["succeeded"],
        "errorRecordCount": counts["errored"],
    }
    if ended is not None:
        body["endTime"] = batch_jobs._rfc3339(ended)
    if job.failed is not None:
        body["message"] = job.failed
    return body


def _find(request: web.Request) -> Job | None:
    ident = request.match_info["job"].rsplit("/", 1)[-1]
    job = request.app[JOBS].jobs.get(ident)
    return job if job is not None and job.api == "bedrock" and job.key == _key(request) else None


async def get(request: web.Request) -> web.Response:
    job = _find(request)
    if job is None:
        return _error(404, "The job was not found.", "ResourceNotFoundException")
    return web.json_response(await _job_body(request.app[JOBS], request.app[STATE], job))


async def stop(request: web.Request) -> web.Response:
    jobs, state = request.app[JOBS], request.app[STATE]
    job = _find(request)
    if job is None:
        return _error(404, "The job was not found.", "ResourceNotFoundException")
    if jobs.ended_s(job, state) is not None:
        return _error(400, "The job has already ended.", "ValidationException")
    job.cancelled_s = time.time()
    return web.json_response({})


async def listing(request: web.Request) -> web.Response:
    jobs, state = request.app[JOBS], request.app[STATE]
    key = _key(request)
    contains = request.query.get("nameContains") or ""
    mine = sorted(
        (
            j
            for j in jobs.jobs.values()
            if j.api == "bedrock"
            and j.key == key
            and contains in str((j.metadata or {}).get("jobName", ""))
        ),
        key=lambda j: j.created_s,
        reverse=True,
    )
    size = int(request.query.get("maxResults") or 100)
    summaries = [await _job_body(jobs, state, j) for j in mine[:size]]
    return web.json_response({"invocationJobSummaries": summaries})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/model-invocation-job", create)
    app.router.add_get("/model-invocation-jobs", listing)
    app.router.add_post("/model-invocation-job/{job:.+}/stop", stop)
    app.router.add_get("/model-invocation-job/{job:.+}", get)
