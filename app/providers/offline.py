"""The providers' own batch APIs, through their official SDKs: create a job of
requests, find it again after a crash, read its state, read its rows, cancel it.

Each request of a job is named ``<tag>:<item id>`` (its ``custom_id``), where the tag
names the job on our side: OpenAI's jobs also carry it in their metadata
(``batchgen_job``), so :meth:`OfflineJobs.find` lists them to recognise a job whose
creation answer was lost; Anthropic's have no metadata, so there a job is found by
the custom ids of its rows once it has ended.

Gemini Batch Mode (``batchGenerateContent``, :class:`GeminiJobs`) names a job by its
display name and each request by its key (``metadata.key`` inline; in a job over the
route's ``inline_max_bytes``, the ``key`` of its line in a JSONL file uploaded to the
Files API, its answers read from the job's results file).

A job holds requests to one endpoint (its batch's): chat completions, or, at OpenAI,
the Responses API or embeddings, each line's body as the item has it (the model
mapped). Rows come back normalised: an answer as a :class:`ProviderResponse` (a
chat answer in OpenAI ``chat.completion`` form, Anthropic's translated as the online
adapter does; a Response or an embeddings list as it came),
anything else as a row kind (``errored``, ``expired``, ``cancelled``) with a code
and a message that never quotes the request. Nothing here writes to the database:
the worker layer records what it reads.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from batchgen.domain.formats.admission import per_choice_max_tokens
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES
from batchgen.domain.formats.message_batches import NATIVE_PARAMS
from batchgen.domain.formats.prompt_cache import with_cache_breakpoint
from batchgen.providers.base import ProviderResponse, safe_code
from batchgen.registry import ModelSpec, ProviderKind

if TYPE_CHECKING:
    import anthropic
    import openai

# The SDKs are imported by the adapters that call them (a worker that never offloads
# loads none of them for this module); an error can only come from one that is loaded.

TAG_KEY = "batchgen_job"
# How many of the provider's most recent jobs :meth:`OfflineJobs.find` looks through.
FIND_LIMIT = 100


# The mark of a row sent as the Messages request it came as (its answer is kept whole).
NATIVE_MARK = "n"


def custom_id(tag: str, item_id: int, *, native: bool = False) -> str:
    return f"{tag}:{NATIVE_MARK if native else ''}{item_id}"


def item_of(custom: str, tag: str) -> int | None:
    """The item id of a row of the job ``tag`` (None: the row is another job's)."""
    prefix, _, item = custom.rpartition(":")
    item = item.removeprefix(NATIVE_MARK)
    return int(item) if prefix == tag and item.isdigit() else None


def is_native(custom: str) -> bool:
    """Whether the row was sent as its own Messages request (:func:`custom_id`)."""
    return custom.rpartition(":")[2].startswith(NATIVE_MARK)


@dataclass(frozen=True)
class OfflineRow:
    """One request of a job: an item's body (OpenAI form), its reserved output tokens,
    the endpoint it goes to (every row of a job the same), and whether its prompt's
    prefix is shared with other items (an Anthropic row then marks it for the cache)."""

    item_id: int
    body: dict[str, Any]
    max_tokens: int
    endpoint: str = CHAT_COMPLETIONS
    cache_prefix: bool = False


class JobStatus(StrEnum):
    RUNNING = "running"  # accepted, rows not all answered yet
    ENDED = "ended"  # every row has its outcome (answered, errored, expired, cancelled)
    FAILED = "failed"  # refused as a whole (validation, limits): no row ran


@dataclass(frozen=True)
class JobState:
    status: JobStatus
    total: int
    succeeded: int
    failed: int
    reason: str | None = None  # why the job failed, a code


class RowKind(StrEnum):
    SUCCEEDED = "succeeded"
    ERRORED = "errored"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class RowResult:
    item_id: int
    kind: RowKind
    response: ProviderResponse | None = None
    error_code: str | None = None
    error_message: str | None = None


class OfflineJobs(Protocol):
    # Does :meth:`find` see a job as soon as it exists (OpenAI), or only once it has
    # ended (Anthropic)? A job not found by the former was never created.
    lists_running: bool

    def create(self, spec: ModelSpec, rows: Sequence[OfflineRow], tag: str) -> str:
        """Create a job of ``rows`` (named by ``tag``; requests to their endpoint);
        returns the provider's job id."""
        ...

    def find(self, spec: ModelSpec, tag: str) -> str | None:
        """The provider's id of the job ``tag`` if it exists (after a lost answer)."""
        ...

    def state(self, spec: ModelSpec, job_id: str) -> JobState: ...

    def results(self, spec: ModelSpec, job_id: str, tag: str) -> Iterator[RowResult]:
        """The rows of an ended job (rows of another tag are skipped)."""
        ...

    def cancel(self, spec: ModelSpec, job_id: str) -> None: ...


def jobs_for(spec: ModelSpec) -> OfflineJobs:
    if spec.provider is ProviderKind.ANTHROPIC:
        return AnthropicJobs()
    if spec.provider is ProviderKind.GEMINI:
        return GeminiJobs()
    if spec.provider is ProviderKind.BEDROCK:
        return BedrockJobs()
    if spec.provider is ProviderKind.VERTEX:
        return VertexJobs()
    return OpenAIJobs()


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of a batch API's error answer, whichever SDK raised it (None: no
    answer, or not an error of a provider's SDK)."""
    if isinstance(exc, _loaded(("openai", "APIStatusError"), ("anthropic", "APIStatusError"))):
        return int(exc.status_code)  # type: ignore[attr-defined]
    if isinstance(exc, _loaded(("google.genai.errors", "APIError"))):
        code = exc.code  # type: ignore[attr-defined]
        return int(code) if code else None
    if isinstance(exc, _loaded(("botocore.exceptions", "ClientError"))):
        status = (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")  # type: ignore[attr-defined]
        return int(status) if status else None
    return None


def _loaded(*names: tuple[str, str]) -> tuple[type[BaseException], ...]:
    """The exception classes ``(module, class)`` of the modules already imported: an
    exception of a module not imported cannot have been raised."""
    return tuple(
        getattr(sys.modules[module], name) for module, name in names if module in sys.modules
    )


def is_provider_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a provider's (an SDK's error, its transport's or a row it could
    not read), which a tick logs and retries later, rather than a bug of ours."""
    return isinstance(
        exc,
        _loaded(
            ("openai", "OpenAIError"),
            ("anthropic", "AnthropicError"),
            ("google.genai.errors", "APIError"),
            ("google.auth.exceptions", "GoogleAuthError"),
            ("httpx", "HTTPError"),
            ("httpx2", "HTTPError"),
            ("botocore.exceptions", "BotoCoreError"),
            ("botocore.exceptions", "ClientError"),
        ),
    )


def _response(body: dict[str, Any], request_id: str | None) -> ProviderResponse:
    """A ``chat.completion`` dict as the answer the recording path takes."""
    choice = (body.get("choices") or [{}])[0]
    usage = body.get("usage") or {}
    return ProviderResponse(
        text=(choice.get("message") or {}).get("content") or "",
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        finish_reason=choice.get("finish_reason"),
        request_id=request_id or body.get("id"),
        body=body,
    )


def _row(
    item_id: int,
    answer: Any,
    translate: Callable[[Any], dict[str, Any]],
    failure: tuple[bool, str, str],
) -> RowResult:
    """A row: its ``answer`` (a dict) as ``translate`` makes it a ``chat.completion`` (an
    answer it cannot read errored as ``malformed_row``); without one, by ``failure``
    ``(cancelled with its job, error code, message)``: cancelled, else errored."""
    if isinstance(answer, dict):
        try:
            body = translate(answer)
        except (KeyError, TypeError, ValueError):
            return RowResult(item_id, RowKind.ERRORED, error_code="malformed_row")
        return RowResult(item_id, RowKind.SUCCEEDED, _response(body, body["id"] or None))
    cancelled, code, message = failure
    if cancelled:
        return RowResult(item_id, RowKind.CANCELLED, error_code="batch_cancelled")
    return RowResult(item_id, RowKind.ERRORED, error_code=code, error_message=message)


def _jsonl(data: bytes) -> Iterator[dict[str, Any]]:
    """The records of a JSONL file (blank lines skipped)."""
    for raw in data.splitlines():
        if raw.strip():
            yield json.loads(raw)


# --- OpenAI: files.create + batches.create -------------------------------------------

_OPENAI_RUNNING = {"validating", "in_progress", "finalizing", "cancelling"}
_OPENAI_ERROR_KINDS = {"batch_expired": RowKind.EXPIRED, "batch_cancelled": RowKind.CANCELLED}
# The endpoint of an answer by its ``object`` (a chat completion's is the default).
_ENDPOINT_OF_OBJECT = {"response": RESPONSES, "list": EMBEDDINGS}


class OpenAIJobs:
    lists_running = True

    def _client(self, spec: ModelSpec) -> openai.OpenAI:
        from batchgen.providers import openai as openai_adapter

        return openai_adapter.sdk_client(spec.base_url, spec.api_key())

    def create(self, spec: ModelSpec, rows: Sequence[OfflineRow], tag: str) -> str:
        endpoint = rows[0].endpoint if rows else CHAT_COMPLETIONS  # one batch's: one
        lines = [
            {
                "custom_id": custom_id(tag, row.item_id),
                "method": "POST",
                "url": endpoint,
                "body": _job_body(spec, row, endpoint),
            }
            for row in rows
        ]
        data = b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)
        client = self._client(spec)
        upload = client.files.create(file=(f"{tag}.jsonl", io.BytesIO(data)), purpose="batch")
        job = client.batches.create(
            input_file_id=upload.id,
            endpoint=endpoint,  # type: ignore[arg-type]
            completion_window="24h",
            metadata={TAG_KEY: tag},
        )
        return job.id

    def find(self, spec: ModelSpec, tag: str) -> str | None:
        page = self._client(spec).batches.list(limit=FIND_LIMIT)
        for job in page.data:
            if (job.metadata or {}).get(TAG_KEY) == tag:
                return job.id
        return None

    def state(self, spec: ModelSpec, job_id: str) -> JobState:
        job = self._client(spec).batches.retrieve(job_id)
        counts = job.request_counts
        total, done, failed = (
            (counts.total, counts.completed, counts.failed) if counts else (0, 0, 0)
        )
        if job.status == "failed":
            errors = job.errors.data if job.errors and job.errors.data else []
            reason = safe_code(errors[0].code) if errors else None
            return JobState(JobStatus.FAILED, total, 0, 0, reason or "failed")
        status = JobStatus.RUNNING if job.status in _OPENAI_RUNNING else JobStatus.ENDED
        return JobState(status, total, done, failed)

    def results(self, spec: ModelSpec, job_id: str, tag: str) -> Iterator[RowResult]:
        client = self._client(spec)
        job = client.batches.retrieve(job_id)
        for file_id in (job.output_file_id, job.error_file_id):
            if not file_id:
                continue
            for raw in client.files.content(file_id).text.splitlines():
                if raw.strip():
                    row = _openai_row(json.loads(raw), tag)
                    if row is not None:
                        yield row

    def cancel(self, spec: ModelSpec, job_id: str) -> None:
        self._client(spec).batches.cancel(job_id)


def _job_body(spec: ModelSpec, row: OfflineRow, endpoint: str) -> dict[str, Any]:
    """A row's request body in the job: the item's, the model mapped; a chat request's
    output bound is one choice's (what the item reserved over ``n``)."""
    body = {k: v for k, v in row.body.items() if k != NATIVE_PARAMS}
    body["model"] = spec.name
    if endpoint == CHAT_COMPLETIONS:
        body["max_tokens"] = per_choice_max_tokens(row.body, row.max_tokens)
    return body


def _openai_answer(body: dict[str, Any], request_id: str | None) -> ProviderResponse:
    """A row's answer by what it is: a Response, an embeddings list, a chat completion."""
    endpoint = _ENDPOINT_OF_OBJECT.get(str(body.get("object")))
    if endpoint is None:
        return _response(body, request_id)
    from batchgen.providers import openai as openai_adapter

    return openai_adapter.endpoint_answer(endpoint, body, request_id)


def _openai_row(line: dict[str, Any], tag: str) -> RowResult | None:
    item_id = item_of(str(line.get("custom_id", "")), tag)
    if item_id is None:
        return None
    response = line.get("response") or {}
    error = line.get("error")
    if not error and response.get("status_code") == 200:
        answer = _openai_answer(response["body"], response.get("request_id"))
        return RowResult(item_id, RowKind.SUCCEEDED, answer)
    if error:
        code = safe_code(error.get("code")) or "batch_error"
        kind = _OPENAI_ERROR_KINDS.get(code, RowKind.ERRORED)
        return RowResult(
            item_id, kind, error_code=code, error_message=f"the provider's job: {code}"
        )
    status = response.get("status_code")
    return RowResult(
        item_id,
        RowKind.ERRORED,
        error_code=f"http_{status}",
        error_message=f"HTTP {status} in the job",
    )


# --- Anthropic: messages.batches ------------------------------------------------------


class AnthropicJobs:
    lists_running = False

    def _client(self, spec: ModelSpec) -> anthropic.Anthropic:
        from batchgen.providers import anthropic as anthropic_adapter

        return anthropic_adapter.sdk_client(spec.base_url, spec.api_key())

    def create(self, spec: ModelSpec, rows: Sequence[OfflineRow], tag: str) -> str:
        from batchgen.providers import anthropic as anthropic_adapter

        requests = []
        for row in rows:
            native = row.body.get(NATIVE_PARAMS)
            if isinstance(native, dict):  # the Messages request as the caller sent it
                params = {k: v for k, v in native.items() if k != "stream"}
                if row.cache_prefix:
                    params = with_cache_breakpoint(params)
                requests.append(
                    {
                        "custom_id": custom_id(tag, row.item_id, native=True),
                        "params": {**params, "model": spec.name},
                    }
                )
                continue
            params = anthropic_adapter.to_messages_request(
                row.body, per_choice_max_tokens(row.body, row.max_tokens)
            )
            extra = params.pop("extra_body", {})
            if row.cache_prefix:
                params = with_cache_breakpoint(params)
            requests.append(
                {
                    "custom_id": custom_id(tag, row.item_id),
                    "params": {**params, **extra, "model": spec.name},
                }
            )
        return self._client(spec).messages.batches.create(requests=requests).id  # type: ignore[arg-type]

    def find(self, spec: ModelSpec, tag: str) -> str | None:
        """Anthropic's jobs carry no metadata: an ended job is ours if its rows are."""
        client = self._client(spec)
        for job in client.messages.batches.list(limit=FIND_LIMIT).data:
            if job.processing_status != "ended":
                continue
            for entry in client.messages.batches.results(job.id):
                if item_of(entry.custom_id, tag) is not None:
                    return job.id
                break
        return None

    def state(self, spec: ModelSpec, job_id: str) -> JobState:
        job = self._client(spec).messages.batches.retrieve(job_id)
        c = job.request_counts
        total = c.processing + c.succeeded + c.errored + c.canceled + c.expired
        status = JobStatus.ENDED if job.processing_status == "ended" else JobStatus.RUNNING
        return JobState(status, total, c.succeeded, c.errored + c.canceled + c.expired)

    def results(self, spec: ModelSpec, job_id: str, tag: str) -> Iterator[RowResult]:
        from batchgen.providers import anthropic as anthropic_adapter

        for entry in self._client(spec).messages.batches.results(job_id):
            item_id = item_of(entry.custom_id, tag)
            if item_id is None:
                continue
            result = entry.result
            if result.type == "succeeded":
                message = result.message
                text = "".join(getattr(block, "text", "") for block in message.content)
                finish = anthropic_adapter.finish_reason(message.stop_reason)
                if is_native(entry.custom_id):  # the Message whole, as the provider sent it
                    whole = message.model_dump(mode="json", exclude_unset=True)
                    answer = ProviderResponse(
                        text=text,
                        prompt_tokens=anthropic_adapter.input_tokens(message.usage),
                        completion_tokens=message.usage.output_tokens,
                        finish_reason=finish,
                        request_id=message.id,
                        body=whole,
                    )
                    yield RowResult(item_id, RowKind.SUCCEEDED, answer)
                    continue
                body = anthropic_adapter.chat_completion(
                    message.id,
                    spec.name,
                    text,
                    finish,
                    anthropic_adapter.input_tokens(message.usage),
                    message.usage.output_tokens,
                    # The cache's reads and writes, priced apart (the batch discount
                    # stacks with the cache's).
                    anthropic_adapter.cache_usage(message.usage),
                )
                yield RowResult(item_id, RowKind.SUCCEEDED, _response(body, message.id))
            elif result.type == "errored":
                code = safe_code(result.error.error.type) or "api_error"
                yield RowResult(
                    item_id,
                    RowKind.ERRORED,
                    error_code=code,
                    error_message=f"the provider's job: {code}",
                )
            elif result.type == "expired":
                yield RowResult(item_id, RowKind.EXPIRED, error_code="batch_expired")
            else:
                yield RowResult(item_id, RowKind.CANCELLED, error_code="batch_cancelled")

    def cancel(self, spec: ModelSpec, job_id: str) -> None:
        self._client(spec).messages.batches.cancel(job_id)


# --- Gemini: Batch Mode (batchGenerateContent, inline requests) ----------------------
#
# Each request carries ``metadata.key`` = its custom id and the job its tag as its
# display name, so :meth:`GeminiJobs.find` lists the jobs (the list shows a job as soon
# as it exists) to adopt one whose creation answer was lost. An ended job's inline
# responses come back as ``chat.completion`` answers (batchgen.domain.formats.gemini_chat),
# its errors as row kinds; an expired job answers none (its rows are then missing, and
# go online).

GEMINI_RUNNING = {
    "JOB_STATE_PENDING",
    "JOB_STATE_QUEUED",
    "JOB_STATE_RUNNING",
    "JOB_STATE_CANCELLING",
}
# A failed job's error code as the reason the tick reads (429: the enqueued-token limit).
GEMINI_FAILED_REASONS = {429: "token_limit_exceeded"}


def _gemini() -> tuple[Any, Any]:
    """The Gemini adapter and format (imported on first use: the SDK's import is heavy)."""
    from batchgen.domain.formats import gemini_chat as gemini_format
    from batchgen.providers import gemini as gemini_adapter

    return gemini_adapter, gemini_format


def _gemini_state(job: Any) -> str:
    state = getattr(job, "state", None)
    return str(getattr(state, "value", state) or "")


def _gemini_failure(cancelled: bool, code: Any) -> tuple[bool, str, str]:
    """A Gemini Batch Mode row's failure (:func:`_row`) by its error code."""
    error = f"error_{code}" if code is not None else "batch_error"
    return cancelled, error, f"the provider's job: error {code}"


class GeminiJobs:
    lists_running = True

    def _client(self, spec: ModelSpec) -> Any:
        return _gemini()[0].client_for(spec)

    def create(self, spec: ModelSpec, rows: Sequence[OfflineRow], tag: str) -> str:
        """Inline requests, or, past the route's ``inline_max_bytes``, a JSONL file of
        ``{"key", "request"}`` lines (the REST form) uploaded to the Files API."""
        _, gemini_format = _gemini()
        kind = spec.provider.value
        lines = [
            json.dumps(
                {
                    "key": custom_id(tag, row.item_id),
                    "request": gemini_format.rest_request(
                        row.body, kind, per_choice_max_tokens(row.body, row.max_tokens)
                    ),
                },
                ensure_ascii=False,
            ).encode()
            for row in rows
        ]
        client = self._client(spec)
        if sum(len(line) + 1 for line in lines) > spec.offline.inline_max_bytes:
            data = b"\n".join(lines) + b"\n"
            upload = client.files.upload(
                file=io.BytesIO(data),
                config={"mime_type": "application/jsonl", "display_name": tag},
            )
            src: Any = str(upload.name)
        else:
            src = [
                {
                    **gemini_format.request(
                        row.body, kind, per_choice_max_tokens(row.body, row.max_tokens)
                    ),
                    "metadata": {"key": custom_id(tag, row.item_id)},
                }
                for row in rows
            ]
        job = client.batches.create(model=spec.name, src=src, config={"display_name": tag})
        return str(job.name)

    def find(self, spec: ModelSpec, tag: str) -> str | None:
        pager = self._client(spec).batches.list(config={"page_size": FIND_LIMIT})
        for i, job in enumerate(pager):
            if job.display_name == tag:
                return str(job.name)
            if i + 1 >= FIND_LIMIT:
                break
        return None

    def state(self, spec: ModelSpec, job_id: str) -> JobState:
        job = self._client(spec).batches.get(name=job_id)
        state = _gemini_state(job)
        if state in GEMINI_RUNNING:
            return JobState(JobStatus.RUNNING, 0, 0, 0)
        if state == "JOB_STATE_FAILED":
            error = getattr(job, "error", None)
            code = getattr(error, "code", None)
            return JobState(
                JobStatus.FAILED, 0, 0, 0, GEMINI_FAILED_REASONS.get(code or 0, "failed")
            )
        responses = (job.dest.inlined_responses if job.dest else None) or []
        ok = sum(1 for r in responses if r.response is not None)
        return JobState(JobStatus.ENDED, len(responses), ok, len(responses) - ok)

    def results(self, spec: ModelSpec, job_id: str, tag: str) -> Iterator[RowResult]:
        gemini_adapter, gemini_format = _gemini()
        job = self._client(spec).batches.get(name=job_id)
        cancelled = _gemini_state(job) == "JOB_STATE_CANCELLED"
        created = int(time.time())
        translate = partial(gemini_format.chat_completion, model=spec.name, created=created)
        file_name = getattr(job.dest, "file_name", None) if job.dest else None
        if file_name:
            data = self._client(spec).files.download(file=file_name)
            for line in _jsonl(data):
                item_id = item_of(str(line.get("key", "")), tag)
                if item_id is None:
                    continue
                failure = _gemini_failure(cancelled, (line.get("error") or {}).get("code"))
                yield _row(item_id, line.get("response"), translate, failure)
            return
        for entry in (job.dest.inlined_responses if job.dest else None) or []:
            item_id = item_of(str((entry.metadata or {}).get("key", "")), tag)
            if item_id is None:
                continue
            answer = None if entry.response is None else gemini_adapter._dump(entry.response)
            failure = _gemini_failure(cancelled, getattr(entry.error, "code", None))
            yield _row(item_id, answer, translate, failure)

    def cancel(self, spec: ModelSpec, job_id: str) -> None:
        self._client(spec).batches.cancel(name=job_id)


# --- Bedrock: batch inference (CreateModelInvocationJob, S3 JSONL in and out) ----------
#
# The input file ``<storage_uri>/<tag>/input.jsonl`` holds one record per row,
# ``{"recordId": <custom id>, "modelInput": <the model's InvokeModel body>}`` (Anthropic
# Claude's Messages body, batchgen.domain.formats.anthropic_messages); the job is named
# by its tag (also its client request token: a retried create makes no second job), so
# :meth:`BedrockJobs.find` lists the jobs by name. Its output,
# ``<output prefix>/<job id>/input.jsonl.out``, holds ``{"recordId", "modelInput",
# "modelOutput"}`` or ``{"recordId", ..., "error"}`` per record; a stopped or expired job
# has only the records it processed (the rest are missing, and go online).

BEDROCK_RUNNING = {"Submitted", "Validating", "Scheduled", "InProgress", "Stopping"}
BEDROCK_ENDED = {"Completed", "PartiallyCompleted", "Stopped", "Expired"}


def _s3_location(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` as ``("bucket", "some/prefix")``."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


def _job_id(job_arn: str) -> str:
    """The job's id (the last part of its ARN), which the API takes as its identifier."""
    return job_arn.rsplit("/", 1)[-1]


class BedrockJobs:
    lists_running = True

    def _clients(self, spec: ModelSpec) -> tuple[Any, Any]:
        from batchgen.providers import bedrock as bedrock_adapter

        route = spec.offline
        region = spec.region or "us-east-1"
        return (
            bedrock_adapter.aws_client("bedrock", region, route.control_url),
            bedrock_adapter.aws_client("s3", region, route.storage_endpoint),
        )

    def _prefix(self, spec: ModelSpec, tag: str) -> tuple[str, str]:
        bucket, prefix = _s3_location(spec.offline.storage_uri or "")
        return bucket, f"{prefix}/{tag}".lstrip("/")

    def create(self, spec: ModelSpec, rows: Sequence[OfflineRow], tag: str) -> str:
        from batchgen.domain.formats import anthropic_messages

        control, s3 = self._clients(spec)
        records = [
            {
                "recordId": custom_id(tag, row.item_id),
                "modelInput": anthropic_messages.request(
                    row.body, per_choice_max_tokens(row.body, row.max_tokens)
                ),
            }
            for row in rows
        ]
        data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)
        bucket, prefix = self._prefix(spec, tag)
        s3.put_object(Bucket=bucket, Key=f"{prefix}/input.jsonl", Body=data)
        job = control.create_model_invocation_job(
            jobName=tag,
            clientRequestToken=tag,
            roleArn=spec.offline.role_arn,
            modelId=spec.name,
            inputDataConfig={
                "s3InputDataConfig": {
                    "s3Uri": f"s3://{bucket}/{prefix}/input.jsonl",
                    "s3InputFormat": "JSONL",
                }
            },
            outputDataConfig={"s3OutputDataConfig": {"s3Uri": f"s3://{bucket}/{prefix}/output/"}},
        )
        return str(job["jobArn"])

    def find(self, spec: ModelSpec, tag: str) -> str | None:
        control, _ = self._clients(spec)
        page = control.list_model_invocation_jobs(nameContains=tag, maxResults=FIND_LIMIT)
        for job in page.get("invocationJobSummaries") or []:
            if job.get("jobName") == tag:
                return str(job["jobArn"])
        return None

    def state(self, spec: ModelSpec, job_id: str) -> JobState:
        control, _ = self._clients(spec)
        job = control.get_model_invocation_job(jobIdentifier=_job_id(job_id))
        status = str(job.get("status"))
        total = int(job.get("totalRecordCount") or 0)
        ok, failed = int(job.get("successRecordCount") or 0), int(job.get("errorRecordCount") or 0)
        if status == "Failed":
            return JobState(JobStatus.FAILED, total, 0, 0, "failed")
        if status in BEDROCK_ENDED:
            return JobState(JobStatus.ENDED, total, ok, failed)
        return JobState(JobStatus.RUNNING, total, ok, failed)

    def results(self, spec: ModelSpec, job_id: str, tag: str) -> Iterator[RowResult]:
        from batchgen.domain.formats import anthropic_messages

        control, s3 = self._clients(spec)
        job = control.get_model_invocation_job(jobIdentifier=_job_id(job_id))
        out_uri = job["outputDataConfig"]["s3OutputDataConfig"]["s3Uri"]
        bucket, prefix = _s3_location(out_uri)
        key = f"{prefix}/{_job_id(job_id)}/input.jsonl.out".lstrip("/")
        try:
            data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as exc:  # no output: a job stopped before it processed any
            if status_of(exc) == 404 or "NoSuchKey" in type(exc).__name__:
                return
            raise
        stopped = job.get("status") in ("Stopped", "Expired")
        created = int(time.time())
        translate = partial(anthropic_messages.chat_completion, model=spec.name, created=created)
        for record in _jsonl(data):
            item_id = item_of(str(record.get("recordId", "")), tag)
            if item_id is None:
                continue
            error = record.get("error") or {}
            code = safe_code(str(error.get("errorCode", ""))) or "batch_error"
            failure = (stopped, f"error_{code}", f"the job: {code}")
            yield _row(item_id, record.get("modelOutput"), translate, failure)

    def cancel(self, spec: ModelSpec, job_id: str) -> None:
        control, _ = self._clients(spec)
        control.stop_model_invocation_job(jobIdentifier=_job_id(job_id))


# --- Vertex AI: batch prediction (Cloud Storage JSONL in and out) ----------------------
#
# The input file ``<storage_uri>/<tag>/input.jsonl`` holds one ``{"request": <a
# GenerateContentRequest>}`` per row, the row's custom id in the request's labels
# (``batchgen_item``: ``<tag>-<item id>``, as label values allow); the job, named by
# its tag, writes ``predictions.jsonl`` files under ``<storage_uri>/<tag>/output``,
# each line its request (labels included) with a ``response`` or a ``status``.

LABEL = "batchgen_item"


def _label(tag: str, item_id: int) -> str:
    return f"{tag}-{item_id}"


def _labelled_item(value: str, tag: str) -> int | None:
    prefix, _, item = value.rpartition("-")
    return int(item) if prefix == tag and item.isdigit() else None


class VertexJobs(GeminiJobs):
    lists_running = True

    def _bucket(self, spec: ModelSpec) -> tuple[Any, str]:
        import google.auth.transport.requests

        from batchgen.providers import cloud_storage

        credentials = _gemini()[0].vertex_credentials(spec)
        credentials.refresh(google.auth.transport.requests.Request())
        bucket, prefix = cloud_storage.location(spec.offline.storage_uri or "")
        store = cloud_storage.Bucket(spec.offline.storage_endpoint, bucket, credentials.token)
        return store, prefix

    def create(self, spec: ModelSpec, rows: Sequence[OfflineRow], tag: str) -> str:
        _, gemini_format = _gemini()
        store, prefix = self._bucket(spec)
        lines = []
        for row in rows:
            request = gemini_format.rest_request(
                row.body,
                spec.provider.value,
                per_choice_max_tokens(row.body, row.max_tokens),
                labels={LABEL: _label(tag, row.item_id)},
            )
            lines.append(json.dumps({"request": request}, ensure_ascii=False).encode())
        folder = f"{prefix}/{tag}".lstrip("/")
        store.put(f"{folder}/input.jsonl", b"\n".join(lines) + b"\n")
        job = self._client(spec).batches.create(
            model=spec.name,
            src=f"gs://{store.bucket}/{folder}/input.jsonl",
            config={"dest": f"gs://{store.bucket}/{folder}/output", "display_name": tag},
        )
        return str(job.name)

    def results(self, spec: ModelSpec, job_id: str, tag: str) -> Iterator[RowResult]:
        _, gemini_format = _gemini()
        job = self._client(spec).batches.get(name=job_id)
        cancelled = _gemini_state(job) == "JOB_STATE_CANCELLED"
        store, prefix = self._bucket(spec)
        folder = f"{prefix}/{tag}/output/".lstrip("/")
        created = int(time.time())
        translate = partial(gemini_format.chat_completion, model=spec.name, created=created)
        failure = (cancelled, "batch_error", "the provider's job: a row failed")
        for name in store.names(folder):
            if not name.endswith(".jsonl"):
                continue
            for line in _jsonl(store.get(name)):
                labels = (line.get("request") or {}).get("labels") or {}
                item_id = _labelled_item(str(labels.get(LABEL, "")), tag)
                if item_id is None:
                    continue
                yield _row(item_id, line.get("response"), translate, failure)
