"""The HTTP API (Flask): OpenAI-Batch-style endpoints scoped to the caller's tenant.

``create_app()`` builds a standalone app; ``blueprint`` can be mounted into a
host app under any prefix (see :mod:`batchgen.integrations.flask`), with
:func:`install_error_handlers` so that every answer below the prefix, errors
included (404, 405, 500, 503), is JSON ``{"error": {"code", "message", …}}``.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import logging
import math
import select
import socket
from collections.abc import Callable, Generator, Iterator
from typing import Any

import redis
from flask import (
    Blueprint,
    Flask,
    Response,
    has_request_context,
    jsonify,
    request,
    stream_with_context,
    url_for,
)
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import HTTPException, NotFound, RequestEntityTooLarge

from batchgen import python_api
from batchgen.bodies import (
    MULTIPART_SLACK_BYTES,
    body_lines,
    cap_body,
    close_if_unread,
    json_body,
    refused_over,
    too_large,
)
from batchgen.config import get_settings
from batchgen.domain.formats import call_rules, call_streams, message_batches
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES, unknown_path
from batchgen.domain.formats.message_batches import MESSAGES
from batchgen.domain.lifecycle.status import Priority, parse_priority
from batchgen.domain.scheduling.offload import OffloadMode, parse_offload
from batchgen.domain.scheduling.routes import RouteMode, parse_route
from batchgen.domain.submission import SubmitOptions
from batchgen.errors import (
    BatchgenError,
    CallFailed,
    ClientError,
    Forbidden,
    Overloaded,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    ValidationFailed,
)
from batchgen.python_api import UNMIGRATED_SQLSTATES, Tenant
from batchgen.request_auth import bearer as _bearer
from batchgen.request_auth import current_key
from batchgen.telemetry import tracing

log = logging.getLogger(__name__)
blueprint = Blueprint("batchgen_api", __name__)
blueprint.after_request(close_if_unread)
# Error codes of the HTTP errors the framework raises (routing, methods, sizes).
HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def _caller() -> Tenant:
    return current_key().tenant


def _limit(default: int) -> int:
    """The ``limit`` query parameter of a list."""
    try:
        return int(request.args.get("limit", default))
    except ValueError as exc:
        raise ValidationFailed("limit must be an integer", field="limit") from exc


def _idempotency_key() -> str | None:
    return request.headers.get("Idempotency-Key")


def _replayed(response: Response, replayed: bool) -> Response:
    """Mark an answer an Idempotency-Key replayed (an earlier batch's or call's)."""
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return response


def _submit_options() -> SubmitOptions:
    args = request.args
    metadata: dict[str, Any] | None = None
    if "metadata" in args:
        try:
            metadata = json.loads(args["metadata"])
        except json.JSONDecodeError as exc:
            raise ValidationFailed("metadata: not valid JSON", field="metadata") from exc
    priority = parse_priority(args.get("priority", Priority.INTERACTIVE))
    return SubmitOptions(
        completion_window=args.get("completion_window"),
        metadata=metadata,
        idempotency_key=_idempotency_key(),
        priority=priority,
        endpoint=args.get("endpoint"),
        offload=parse_offload(args.get("offload")),
        route=parse_route(args.get("route")),
        on_finished=args.get("on_finished"),
        on_finished_queue=args.get("on_finished_queue"),
        webhook_url=args.get("webhook_url"),
        key_id=current_key().key_id,
    )


# The largest JSON body read whole to look for ``input_file_id`` (the SDK's request).
MAX_JSON_REQUEST_BYTES = 1024 * 1024


def _file_batch_request() -> dict[str, Any] | None:
    """The JSON body of ``client.batches.create(input_file_id=…)``, or None for a JSONL
    body (our own submit: the request lines themselves)."""
    if request.mimetype != "application/json":
        return None
    size = request.content_length
    if size is None or size > MAX_JSON_REQUEST_BYTES:  # the SDK's request is small and sized
        return None
    try:
        body = json.loads(request.get_data(cache=True) or b"null")
    except ValueError:
        return None
    return body if isinstance(body, dict) and "input_file_id" in body else None


def _create_from_file(tenant: Tenant, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    extra = {k: body[k] for k in ("priority", "offload", "route") if k in body}
    told = {k: body.get(k, request.args.get(k)) for k in python_api.TOLD}
    for key in ("input_file_id", "endpoint", "completion_window"):
        if key in body and not isinstance(body[key], str):
            raise ValidationFailed(f"{key} must be a string", field=key)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValidationFailed("metadata must be an object", field="metadata")
    return python_api.create_batch(
        tenant=tenant,
        input_file_id=body["input_file_id"],
        endpoint=body.get("endpoint"),
        completion_window=body.get("completion_window", "24h"),
        metadata=metadata,
        idempotency_key=_idempotency_key(),
        priority=extra.get("priority", request.args.get("priority")),
        offload=extra.get("offload", request.args.get("offload", OffloadMode.AUTO)),
        route=extra.get("route", request.args.get("route", RouteMode.AUTO)),
        key_id=current_key().key_id,
        **told,
    )


def _body_source(max_bytes: int) -> Iterator[bytes]:
    """The JSONL body: the bytes already read (a JSON body that named no file), or the
    stream, read under ``max_bytes``."""
    size = request.content_length
    if (
        request.mimetype == "application/json"
        and size is not None
        and size <= MAX_JSON_REQUEST_BYTES
    ):
        return iter(request.get_data(cache=True).splitlines(keepends=True))
    return body_lines(max_bytes)


@blueprint.post("/v1/batches")
def create_batch() -> tuple[Response, int]:
    """Either SDK's flow (a JSON body naming an uploaded ``input_file_id``) or our
    own: the JSONL request lines as the body, options in the query."""
    tenant = _caller()
    limit = get_settings().submit.max_body_bytes
    cap_body(limit)
    from_file = _file_batch_request()
    if from_file is not None:
        described, created = _create_from_file(tenant, from_file)
    else:
        described, created = python_api.submit(tenant, _body_source(limit), _submit_options())
    return _replayed(jsonify(described), not created), 200


@blueprint.get("/v1/batches")
def list_batches() -> Response:
    limit = _limit(20)
    page = python_api.list_batches_page(
        tenant=_caller(), limit=limit, after=request.args.get("after")
    )
    return jsonify(page)


@blueprint.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str) -> Response:
    return jsonify(python_api.get_batch(batch_id, tenant=_caller()))


@blueprint.get("/v1/batches/<batch_id>/notifications")
def batch_notifications(batch_id: str) -> Response:
    """How the batch's end was announced: each channel, its attempts and status."""
    data = python_api.batch_notifications(batch_id, tenant=_caller())
    return jsonify(python_api.list_object(data, False))


@blueprint.get("/v1/batches/<batch_id>/results")
def batch_results(batch_id: str) -> Response:
    tenant = _caller()
    python_api.check_batch(batch_id, tenant=tenant)  # 404 before the stream starts

    def lines() -> Iterator[bytes]:
        for row in python_api.iter_results(batch_id, tenant=tenant):
            yield json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n"

    return Response(stream_with_context(lines()), mimetype="application/jsonl")


@blueprint.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    return jsonify(python_api.cancel_batch(batch_id, tenant=_caller()))


# -- files (the OpenAI Files API) ----------------------------------------------------


def _expires_after_s() -> int | None:
    """``expires_after[anchor]=created_at`` and ``expires_after[seconds]=N`` (the SDK's
    form fields), or None."""
    form = request.form
    seconds = form.get("expires_after[seconds]")
    if seconds is None:
        return None
    if form.get("expires_after[anchor]", "created_at") != "created_at":
        raise ValidationFailed("expires_after[anchor] must be 'created_at'", field="expires_after")
    try:
        return int(seconds)
    except ValueError as exc:
        raise ValidationFailed(
            "expires_after[seconds] must be an integer", field="expires_after"
        ) from exc


@blueprint.post("/v1/files")
def upload_file() -> Response:
    tenant = _caller()
    limit = get_settings().submit.max_body_bytes
    # The multipart parser reads through the capped stream: past the cap it stops, and
    # what it spooled to disk goes with the request.
    cap_body(limit + MULTIPART_SLACK_BYTES, f"file larger than {limit} bytes")
    with refused_over():
        upload = request.files.get("file")
    if upload is None:
        raise ValidationFailed("a multipart field 'file' is required", field="file")
    content = upload.stream.read(limit + 1)
    if len(content) > limit:
        raise PayloadTooLarge(f"file larger than {limit} bytes")
    return jsonify(
        python_api.upload_file(
            content,
            tenant=tenant,
            filename=upload.filename or "upload.jsonl",
            purpose=request.form.get("purpose", ""),
            expires_after_s=_expires_after_s(),
        )
    )


@blueprint.get("/v1/files")
def list_files() -> Response:
    limit = _limit(10_000)
    page = python_api.list_files_page(
        tenant=_caller(),
        limit=limit,
        after=request.args.get("after"),
        order=request.args.get("order", "desc"),
        purpose=request.args.get("purpose"),
    )
    return jsonify(page)


@blueprint.get("/v1/files/<file_id>")
def get_file(file_id: str) -> Response:
    return jsonify(python_api.get_file(file_id, tenant=_caller()))


@blueprint.get("/v1/files/<file_id>/content")
def file_content(file_id: str) -> Response:
    tenant = _caller()
    python_api.check_file(file_id, tenant=tenant)  # 404 before the stream starts
    chunks = python_api.iter_file_content(file_id, tenant=tenant)
    return Response(stream_with_context(chunks), mimetype="application/octet-stream")


@blueprint.delete("/v1/files/<file_id>")
def delete_file(file_id: str) -> Response:
    return jsonify(python_api.delete_file(file_id, tenant=_caller()))


# -- Anthropic's Message Batches ---------------------------------------------------


def _results_url(batch_id: str) -> str:
    """Where this API serves a Message Batch's results (absolute: the SDK follows it)."""
    return url_for("batchgen_api.message_batch_results", batch_id=batch_id, _external=True)


@blueprint.post("/v1/messages/batches")
def create_message_batch() -> Response:
    tenant = _caller()
    body = json_body(get_settings().submit.max_body_bytes)
    if not isinstance(body, dict):
        raise ValidationFailed("the body must be a JSON object with 'requests'", field="requests")
    described, created = python_api.create_message_batch(
        body.get("requests"),  # type: ignore[arg-type]
        tenant=tenant,
        idempotency_key=_idempotency_key(),
        priority=body.get("priority"),
        offload=body.get("offload", OffloadMode.AUTO),
        route=body.get("route", RouteMode.AUTO),
        key_id=current_key().key_id,
        **{k: body.get(k) for k in python_api.TOLD},
    )
    return _replayed(jsonify(described), not created)


@blueprint.get("/v1/messages/batches")
def list_message_batches() -> Response:
    page = python_api.list_message_batches_page(
        tenant=_caller(),
        limit=_limit(20),
        after_id=request.args.get("after_id"),
        before_id=request.args.get("before_id"),
        results_url=_results_url,
    )
    return jsonify(page)


@blueprint.get("/v1/messages/batches/<batch_id>")
def get_message_batch(batch_id: str) -> Response:
    return jsonify(
        python_api.get_message_batch(batch_id, tenant=_caller(), results_url=_results_url)
    )


@blueprint.post("/v1/messages/batches/<batch_id>/cancel")
def cancel_message_batch(batch_id: str) -> Response:
    return jsonify(python_api.cancel_message_batch(batch_id, tenant=_caller()))


@blueprint.get("/v1/messages/batches/<batch_id>/results")
def message_batch_results(batch_id: str) -> Response:
    tenant = _caller()
    python_api.get_message_batch(batch_id, tenant=tenant)  # 404 before the stream starts

    def lines() -> Iterator[bytes]:
        for row in python_api.iter_message_batch_results(batch_id, tenant=tenant):
            yield json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n"

    return Response(stream_with_context(lines()), mimetype="application/binary")


# -- synchronous calls through the scheduler -----------------------------------------


def _caller_connected() -> bool:
    """Whether the caller's connection is still open, where the server says which
    socket it is (werkzeug, gunicorn): a socket that reads as closed (EOF) is a caller
    gone. Elsewhere the answer is always yes (the call then runs to its end)."""
    sock = request.environ.get("werkzeug.socket") or request.environ.get("gunicorn.socket")
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return not readable or bool(sock.recv(1, socket.MSG_PEEK))
    except (OSError, ValueError):
        return False


def _call_body() -> Any:
    """A synchronous call's JSON body: read once the key is known, under its own cap."""
    _caller()
    return json_body(get_settings().submit.max_call_body_bytes)


def _deadline_s(body_timeout: Any) -> float:
    settings = get_settings()
    return call_rules.call_deadline_s(
        body_timeout,
        {name.lower(): value for name, value in request.headers.items()},
        settings.calls.default_timeout_s,
        settings.calls.max_timeout_s,
    )


def _run_call(line: dict[str, Any], endpoint: str, body_timeout: Any) -> tuple[Any, bool]:
    """A call's answer, and whether its Idempotency-Key replayed an earlier call's."""
    pending = python_api.start_call(
        line,
        tenant=_caller(),
        key_id=current_key().key_id,
        has_budget=current_key().has_budget,
        endpoint=endpoint,
        deadline_s=_deadline_s(body_timeout),
        idempotency_key=_idempotency_key(),
    )
    answer = python_api.wait_call(pending, _caller_connected).response
    return answer, pending.stored.replayed


def _stream_call(
    line: dict[str, Any], endpoint: str, body_timeout: Any
) -> tuple[Generator[python_api.StreamPart, None, None], bool]:
    """A streamed call's parts, once its first one is in: until then, an error is the
    answer's status (a 429, a 503, a 504...); after it, an error event of the stream.
    Also whether its Idempotency-Key replayed an earlier call (whose whole answer of
    record is then the one part)."""
    pending = python_api.start_call(
        line,
        tenant=_caller(),
        key_id=current_key().key_id,
        has_budget=current_key().has_budget,
        endpoint=endpoint,
        deadline_s=_deadline_s(body_timeout),
        stream=True,
        idempotency_key=_idempotency_key(),
    )
    parts = python_api.stream_call(pending, _caller_connected)
    try:
        first = next(parts)
    except StopIteration:  # never: a stream ends with its answer or an error
        raise CallFailed(502, "upstream_error", "the call ended without an answer") from None

    def started() -> Generator[python_api.StreamPart, None, None]:
        try:
            yield first
            yield from parts
        finally:
            parts.close()  # also when closed before the first part was written

    return started(), pending.stored.replayed


def _event_stream(
    chunks: Iterator[bytes], parts: Generator[python_api.StreamPart, None, None] | None = None
) -> Response:
    """The server-sent events ``chunks`` makes of the call's ``parts`` (if it streams
    them), closed (the call cancelled, if it was not over) when the response is, also
    when the caller hung up. Without ``parts``, ``chunks`` replays a finished answer."""

    def guarded() -> Iterator[bytes]:
        try:
            yield from chunks
        except CallFailed as exc:  # mid-stream: the status line is long gone
            body = _error_body(exc.status_code, exc.to_dict())
            yield call_rules.sse(body, "error" if _anthropic_client() else None)
        finally:
            if parts is not None:
                parts.close()

    response = Response(stream_with_context(guarded()), mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    return response


@blueprint.post("/v1/chat/completions")
def chat_completions() -> Response:
    """A chat completion through the scheduler: queued, budgeted, recorded like an item;
    answered when it ends, or, streamed, with the provider's chunks as they arrive."""
    body = _call_body()
    line, stream, include_usage = call_rules.as_line(body)
    if stream:
        parts, replayed = _stream_call(line, CHAT_COMPLETIONS, body.get("timeout"))
        sse = _event_stream(call_streams.openai_sse(parts, include_usage), parts)
        return _replayed(sse, replayed)
    answer, replayed = _run_call(line, CHAT_COMPLETIONS, body.get("timeout"))
    return _replayed(jsonify(answer), replayed)


@blueprint.post("/v1/messages")
def messages() -> Response:
    """Anthropic's Messages API through the scheduler (plain or streamed)."""
    body = _call_body()
    if not isinstance(body, dict):
        raise ValidationFailed("the body must be a JSON object", field="body")
    stream = bool(body.get("stream"))
    params = {k: v for k, v in body.items() if k not in ("stream", "timeout")}
    line = python_api.message_line(0, {"custom_id": call_rules.CALL_CUSTOM_ID, "params": params})
    if stream:
        parts, replayed = _stream_call(line, MESSAGES, body.get("timeout"))
        return _replayed(_event_stream(call_streams.anthropic_sse(parts), parts), replayed)
    answer, replayed = _run_call(line, MESSAGES, body.get("timeout"))
    return _replayed(jsonify(message_batches.to_message(answer)), replayed)


@blueprint.post("/v1/responses")
def responses() -> Response:
    """OpenAI's Responses API through the scheduler (as a chat completion is): the
    provider's Response whole, or, with ``stream``, the events of its stream."""
    body = _call_body()
    line, stream, _ = call_rules.as_line(body, RESPONSES)
    answer, replayed = _run_call(line, RESPONSES, body.get("timeout"))
    if stream:
        return _replayed(_event_stream(call_rules.responses_stream(answer)), replayed)
    return _replayed(jsonify(answer), replayed)


@blueprint.post("/v1/embeddings")
def embeddings() -> Response:
    """Embeddings through the scheduler: the provider's list of embeddings whole."""
    body = _call_body()
    line, _, _ = call_rules.as_line(body, EMBEDDINGS)
    answer, replayed = _run_call(line, EMBEDDINGS, body.get("timeout"))
    return _replayed(jsonify(answer), replayed)


def _anthropic_client() -> bool:
    """The Anthropic SDK sends ``anthropic-version`` on every request; OpenAI's does not."""
    return "anthropic-version" in request.headers


@blueprint.get("/v1/models")
def list_models() -> Response:
    """The registry's models, as ``client.models.list()`` of either SDK reads them."""
    _caller()
    if not _anthropic_client():
        return jsonify({"object": "list", "data": python_api.list_models()})
    limit = _limit(20)
    page = python_api.list_models_page(
        limit=limit,
        after_id=request.args.get("after_id"),
        before_id=request.args.get("before_id"),
    )
    return jsonify(page)


@blueprint.get("/v1/models/<path:name>")
def get_model(name: str) -> Response:
    _caller()
    return jsonify(python_api.get_model(name, anthropic=_anthropic_client()))


@blueprint.get("/v1/usage")
def usage() -> Response:
    """The caller's usage; an admin key may ask ``tenant=all`` for every tenant."""
    tenant = _caller()
    everyone = request.args.get("tenant") == "all"
    if everyone and not tenant.is_admin:
        raise Forbidden("tenant=all needs an admin key")
    group_by = request.args.get("group_by", "model")
    if group_by == "tenant" and not everyone:
        raise ValidationFailed("group_by=tenant needs tenant=all", field="group_by")
    rows = python_api.usage(
        tenant=None if everyone else tenant,
        start=request.args.get("from"),
        end=request.args.get("to"),
        group_by=group_by,
    )
    return jsonify({"object": "list", "group_by": group_by, "data": rows})


@blueprint.get("/v1/status")
def status() -> Response:
    """Per-model backlog, throughput and budget use, per-tenant progress (admin only)."""
    if not _caller().is_admin:
        raise Forbidden("the status view needs an admin key")
    from batchgen.limits.backend import get_redis
    from batchgen.monitoring.queues import queue_view
    from batchgen.registry import get_registry

    data = python_api.status_snapshot()
    return jsonify({**data, **queue_view(get_registry(), get_settings(), get_redis())})


def _check_metrics_access() -> None:
    """The metrics token (compared in constant time) or an admin API key; never open."""
    presented = _bearer()
    if presented is None:
        raise Unauthorized(
            "metrics need 'Authorization: Bearer <BATCHGEN_METRICS_TOKEN or an admin key>'"
        )
    token = get_settings().api.metrics_token
    if token and hmac.compare_digest(presented.encode(), token.encode()):
        return
    if not _caller().is_admin:
        raise Forbidden("metrics need the metrics token or an admin key")


@blueprint.get("/metrics")
def metrics() -> Response:
    """Prometheus metrics for the whole deployment (bearer ``BATCHGEN_METRICS_TOKEN``
    or an admin key: they name tenants and their usage)."""
    _check_metrics_access()
    from batchgen.limits.backend import get_redis
    from batchgen.monitoring.metrics import StateCollector, render
    from batchgen.registry import get_registry

    settings = get_settings()
    broker = get_redis(settings.broker_url) if settings.broker_url.startswith("redis") else None
    collector = StateCollector(
        python_api.session_factory(), get_redis(), get_registry(), settings, broker
    )
    return Response(render(collector), mimetype="text/plain; version=0.0.4")


@blueprint.get("/healthz")
def healthz() -> Response:
    return jsonify({"ok": True})


def _retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


# Anthropic's error types by HTTP status (its SDK maps the status to an exception;
# the type is what its users read).
ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def _error_body(status: int, body: dict[str, object]) -> dict[str, object]:
    """``{"error": {code, message, ...}}`` (OpenAI's shape), or Anthropic's
    ``{"type": "error", "error": {type, message, code, ...}}`` for a request from its SDK."""
    if not (has_request_context() and _anthropic_client()):
        return {"error": body}
    kind = ANTHROPIC_ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, **body}}


def _error_response(
    status: int, body: dict[str, object], retry_after_s: float | None = None
) -> tuple[Response, int]:
    response = jsonify(_error_body(status, body))
    if retry_after_s is not None:
        response.headers["Retry-After"] = _retry_after(retry_after_s)
    return response, status


@blueprint.app_errorhandler(BatchgenError)
def handle_error(exc: BatchgenError) -> tuple[Response, int]:
    if isinstance(exc, ClientError | Overloaded | Unavailable | CallFailed):
        return _error_response(exc.status_code, exc.to_dict(), getattr(exc, "retry_after_s", None))
    log.error("internal error: %s", type(exc).__name__)
    return _error_response(500, {"code": "internal", "message": "internal error"})


def unavailable(exc: BaseException, retry_after_s: float) -> Unavailable | None:
    """The 503 for an exception that says PostgreSQL or Redis is unreachable, else None.

    Pure. Pool time-outs (no free connection), refused or dropped connections
    and a server shutting down are the database's; connection errors and
    time-outs are Redis's. A table or column that does not exist means the
    database was not migrated: the answer names the command that does it.
    """
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.TimeoutError):
        return Unavailable(
            "database_unavailable",
            "the database is unavailable; retry later",
            retry_after_s=retry_after_s,
        )
    if isinstance(exc, sa_exc.ProgrammingError) and _sqlstate(exc) in UNMIGRATED_SQLSTATES:
        return Unavailable(
            "database_not_migrated",
            "the database schema is not at this batchgen's newest migration: "
            "run `batchgen db upgrade`",
            retry_after_s=retry_after_s,
        )
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | redis.BusyLoadingError):
        return Unavailable(
            "redis_unavailable", "Redis is unavailable; retry later", retry_after_s=retry_after_s
        )
    return None


def _sqlstate(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    return str(getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None) or "-")


def _under(prefix: str) -> bool:
    return not prefix or request.path == prefix or request.path.startswith(prefix + "/")


Handler = Callable[[Any], Any]


def _http_error(prefix: str, host_handler: Handler | None, exc: HTTPException) -> Any:
    if not _under(prefix):  # the host app's own page
        return host_handler(exc) if host_handler else exc
    code = exc.code or 500
    if isinstance(exc, RequestEntityTooLarge):  # a read passed the body's cap
        return handle_error(too_large())
    message = exc.description or exc.name
    path = request.path[len(prefix) :]
    if isinstance(exc, NotFound) and path.startswith("/v1/"):  # an endpoint we do not serve
        message = unknown_path(request.method, path)
    response, status = _error_response(
        code, {"code": HTTP_CODES.get(code, "http_error"), "message": message}
    )
    allow = getattr(exc, "valid_methods", None)
    if allow:
        response.headers["Allow"] = ", ".join(allow)
    return response, status


def _unexpected_error(prefix: str, host_handler: Handler | None, exc: Exception) -> Any:
    """Any other exception under the API: a JSON 503 or 500. The log carries the
    class and SQLSTATE only: a driver's message may quote the request."""
    if not _under(prefix):  # the host app's own handling
        if host_handler:
            return host_handler(exc)
        raise exc
    answer = unavailable(exc, get_settings().api.unavailable_retry_after_s)
    if answer is not None:
        log.warning(
            "%s %s: %s (%s, sqlstate %s)",
            request.method,
            request.path,
            answer.code,
            type(exc).__name__,
            _sqlstate(exc),
        )
        return handle_error(answer)
    log.error(
        "%s %s: internal error (%s, sqlstate %s)",
        request.method,
        request.path,
        type(exc).__name__,
        _sqlstate(exc),
    )
    return _error_response(500, {"code": "internal", "message": "internal error"})


def install_error_handlers(app: Flask, prefix: str = "") -> None:
    """Answer every error below ``prefix`` (everything, for ``""``) as JSON.

    Paths outside the prefix keep the host app's own error pages and handling.
    """
    prefix = prefix.rstrip("/")
    existing = app.error_handler_spec[None][None]
    for kind, handler in ((HTTPException, _http_error), (Exception, _unexpected_error)):
        host_handler = existing.get(kind)
        app.register_error_handler(kind, functools.partial(handler, prefix, host_handler))


def create_app() -> Flask:
    """A standalone Flask app serving the API at the root."""
    from batchgen.logs import configure_logging

    configure_logging()
    tracing.setup_from_env("batchgen-api")  # off unless the OTEL_* variables say
    from batchgen.admin_api import admin_blueprint
    from batchgen.dashboard import dashboard

    app = Flask("batchgen")
    app.register_blueprint(blueprint)
    app.register_blueprint(dashboard)
    app.register_blueprint(admin_blueprint)
    install_error_handlers(app)
    load_encodings()
    warm_providers()
    check_schema()
    return app


def warm_providers() -> None:
    """Import the provider SDKs and build their clients now (seconds, once per
    process), not inside the first synchronous call (``BATCHGEN_WARM_UP``)."""
    from batchgen.providers import get_provider
    from batchgen.registry import get_registry

    if not get_settings().providers.warm_up:
        return
    with contextlib.suppress(Exception):  # a broken registry: the requests report it
        for spec in get_registry():
            with contextlib.suppress(Exception):  # a missing key: its calls report it
                get_provider(spec).warm(spec)


def check_schema() -> None:
    """Log, at start, a database that is not at the newest migration (its requests then
    answer 503 ``database_not_migrated``); an unreachable one is its requests' 503."""
    if not get_settings().database.url:
        return
    try:
        behind = python_api.schema_behind()
    except Exception as exc:
        log.warning("database not checked at start (%s)", type(exc).__name__)
        return
    if behind is not None:
        log.error("%s", behind)


def load_encodings() -> None:
    """Load the registry's tokenizers now (tiktoken takes about 0.1 s for each), not
    inside the first submit. A broken registry is reported by the requests that need it."""
    from batchgen.domain.formats.tokens import get_encoding
    from batchgen.registry import get_registry

    with contextlib.suppress(Exception):
        for name in {spec.encoding for spec in get_registry()}:
            get_encoding(name)
