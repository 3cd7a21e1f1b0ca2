"""The HTTP API (Flask): OpenAI-Batch-style endpoints scoped to the caller's tenant.

``create_app()`` builds a standalone app; ``blueprint`` can be mounted into a
host app under any prefix (see :mod:`app.integrations.flask`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Flask, Response, g, jsonify, request, stream_with_context
from sqlalchemy.orm import Session

from app import batches, client
from app.batches import SubmitOptions
from app.config import get_settings
from app.db import session_scope
from app.errors import (
    BatchgenError,
    ClientError,
    Forbidden,
    Overloaded,
    PayloadTooLarge,
    Unauthorized,
    ValidationFailed,
)
from app.schema import Tenant
from app.status import Priority
from app.tenants import authenticate

blueprint = Blueprint("batchgen", __name__)
READ_CHUNK_BYTES = 1 << 16


def _bearer() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _caller() -> Tenant:
    if "tenant" not in g:
        with session_scope() as session:
            g.tenant = authenticate(session, _bearer())
    tenant: Tenant = g.tenant
    return tenant


def _reload(session: Session, tenant: Tenant) -> Tenant:
    """The authenticated tenant, attached to ``session``."""
    return session.merge(tenant, load=False)


def _body_lines() -> Iterator[bytes]:
    """The request body, line by line, without reading it whole into memory."""
    stream = request.stream
    while True:
        line = stream.readline()
        if not line:
            return
        yield line


def _submit_options() -> SubmitOptions:
    args = request.args
    metadata: dict[str, Any] | None = None
    if "metadata" in args:
        try:
            metadata = json.loads(args["metadata"])
        except json.JSONDecodeError as exc:
            raise ValidationFailed("metadata: not valid JSON", field="metadata") from exc
    try:
        priority = Priority(args.get("priority", Priority.INTERACTIVE))
    except ValueError as exc:
        raise ValidationFailed(
            "priority must be 'interactive' or 'bulk'", field="priority"
        ) from exc
    return SubmitOptions(
        completion_window=args.get("completion_window", "24h"),
        metadata=metadata,
        idempotency_key=request.headers.get("Idempotency-Key"),
        priority=priority,
    )


@blueprint.post("/v1/batches")
def create_batch() -> tuple[Response, int]:
    tenant = _caller()
    settings = get_settings()
    if request.content_length and request.content_length > settings.max_body_bytes:
        raise PayloadTooLarge(f"body larger than {settings.max_body_bytes} bytes")
    options = _submit_options()
    with session_scope() as session:
        described, created = client.submit_in_session(
            session, _reload(session, tenant), _body_lines(), options
        )
    if created:
        client.wake_dispatcher()
    response = jsonify(described)
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
    return response, 200


@blueprint.get("/v1/batches")
def list_batches() -> Response:
    try:
        limit = int(request.args.get("limit", 20))
    except ValueError as exc:
        raise ValidationFailed("limit must be an integer", field="limit") from exc
    data = client.list_batches(tenant=_caller(), limit=limit, after=request.args.get("after"))
    return jsonify(
        {
            "object": "list",
            "data": data,
            "has_more": len(data) == limit,
            "last_id": data[-1]["id"] if data else None,
        }
    )


@blueprint.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str) -> Response:
    return jsonify(client.get_batch(batch_id, tenant=_caller()))


@blueprint.get("/v1/batches/<batch_id>/results")
def batch_results(batch_id: str) -> Response:
    tenant = _caller()
    with session_scope() as session:  # 404 before the stream starts
        batches.get_owned_batch(session, _reload(session, tenant), batch_id)

    def lines() -> Iterator[bytes]:
        for row in client.iter_results(batch_id, tenant=tenant):
            yield json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n"

    return Response(stream_with_context(lines()), mimetype="application/jsonl")


@blueprint.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    return jsonify(client.cancel_batch(batch_id, tenant=_caller()))


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
    rows = client.usage(
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
    from app.redis_client import get_redis
    from app.registry import get_registry
    from app.status_view import snapshot

    with session_scope() as session:
        return jsonify(snapshot(session, get_redis(), get_registry(), get_settings()))


@blueprint.get("/metrics")
def metrics() -> Response:
    """Prometheus metrics for the whole deployment (bearer ``BATCHGEN_METRICS_TOKEN`` if set)."""
    token = get_settings().metrics_token
    if token and _bearer() != token:
        raise Unauthorized("metrics need 'Authorization: Bearer <BATCHGEN_METRICS_TOKEN>'")
    from app.metrics import StateCollector, render
    from app.redis_client import get_redis
    from app.registry import get_registry

    settings = get_settings()
    broker = get_redis(settings.broker_url) if settings.broker_url.startswith("redis") else None
    collector = StateCollector(session_scope, get_redis(), get_registry(), settings, broker)
    return Response(render(collector), mimetype="text/plain; version=0.0.4")


@blueprint.get("/healthz")
def healthz() -> Response:
    return jsonify({"ok": True})


def _retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


@blueprint.app_errorhandler(BatchgenError)
def handle_error(exc: BatchgenError) -> tuple[Response, int]:
    if isinstance(exc, ClientError | Overloaded):
        response = jsonify({"error": exc.to_dict()})
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after is not None:
            response.headers["Retry-After"] = _retry_after(retry_after)
        return response, exc.status_code
    return jsonify({"error": {"code": "internal", "message": type(exc).__name__}}), 500


def create_app() -> Flask:
    """A standalone Flask app serving the API at the root."""
    from app.logs import configure_logging

    configure_logging()
    app = Flask("batchgen")
    app.register_blueprint(blueprint)
    return app
