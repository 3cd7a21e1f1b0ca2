"""The batch dashboard: server-rendered pages under ``/dashboard``, behind the same
API keys, with no build step.

- A tenant sees its batches: progress, counts by status, error codes, a download of
  the results, cancel; and submits a JSONL file.
- An admin key also sees, per model, the backlog, slots, budget use and provider
  429s, and per tenant today's usage and cost.

The page refreshes its tables live: a few lines of script fetch the server-rendered
fragment (``/dashboard/fragment``) every ``REFRESH_MS`` and swap it in. The key is
kept in an HttpOnly, SameSite=Strict cookie; every form that changes something
carries a token derived from it (``csrf``), so another site cannot post them.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, redirect, render_template, request, url_for
from werkzeug.wrappers import Response as BaseResponse

from batchgen import python_api
from batchgen.bodies import (
    MULTIPART_SLACK_BYTES,
    cap_body,
    close_if_unread,
    read_body,
    refused_over,
)
from batchgen.config import get_settings
from batchgen.domain.status import ItemStatus
from batchgen.errors import BatchgenError, PayloadTooLarge, Unauthorized
from batchgen.store import batches, tenants
from batchgen.store.db import session_scope
from batchgen.store.schema import Tenant

dashboard = Blueprint("dashboard", __name__, template_folder="templates")

COOKIE = "batchgen_key"
REFRESH_MS = 2000
LIST_LIMIT = 50


# A dashboard form (sign-in, cancel) is a few short fields: its body is read no further.
FORM_MAX_BYTES = 64 * 1024


@dashboard.before_request
def _cap_forms() -> BaseResponse | None:
    """Read a dashboard form under its cap before a view parses it (Werkzeug reads a
    URL-encoded form whole); the upload has its own cap, set once its cookie is checked."""
    if request.endpoint == "dashboard.submit" or request.method != "POST":
        return None
    try:
        read_body(FORM_MAX_BYTES, f"form larger than {FORM_MAX_BYTES} bytes")
    except PayloadTooLarge as exc:
        return _refused(exc)
    return None


def _refused(exc: PayloadTooLarge) -> BaseResponse:
    return close_if_unread(Response(str(exc), status=413, mimetype="text/plain"))


def _key() -> str | None:
    return request.cookies.get(COOKIE) or None


def _tenant() -> Tenant | None:
    key = _key()
    if key is None:
        return None
    try:
        with session_scope() as session:
            tenant = tenants.authenticate(session, key)
            session.expunge(tenant)
            return tenant
    except Unauthorized:
        return None


def csrf_token(key: str) -> str:
    """The token the dashboard's forms carry: bound to the key in the cookie."""
    return hmac.new(key.encode(), b"batchgen-dashboard-csrf", hashlib.sha256).hexdigest()


def _csrf_ok() -> bool:
    key = _key()
    return key is not None and hmac.compare_digest(request.form.get("csrf", ""), csrf_token(key))


def _progress(counts: dict[str, int]) -> dict[str, Any]:
    total = counts.get("total", 0) or 0
    done = sum(counts.get(s, 0) for s in ("succeeded", "failed", "expired", "cancelled"))
    return {"done": done, "total": total, "pct": int(100 * done / total) if total else 100}


def _view(tenant: Tenant) -> dict[str, Any]:
    """Everything the page shows for this key."""
    rows = []
    listed = python_api.list_batches(tenant=tenant, limit=LIST_LIMIT)
    with session_scope() as session:
        errors = batches.error_codes(session, [b["id"] for b in listed])
    for batch in listed:
        counts = batch["request_counts"]
        rows.append(
            {
                "id": batch["id"],
                "status": batch["status"],
                "priority": batch.get("priority"),
                "created": dt.datetime.fromtimestamp(batch["created_at"], dt.UTC).strftime(
                    "%Y-%m-%d %H:%M:%S"
                ),
                "counts": {s.value: counts[s.value] for s in ItemStatus if counts.get(s.value)},
                "progress": _progress(counts),
                "errors": errors.get(batch["id"], {}),
                "finished": batch["finished_at"] is not None,
            }
        )
    view: dict[str, Any] = {"tenant": tenant.name, "batches": rows, "admin": tenant.is_admin}
    if tenant.is_admin:
        view.update(_admin_view(tenant))
    return view


def _admin_view(tenant: Tenant) -> dict[str, Any]:
    from batchgen.limits import counters
    from batchgen.limits.backend import get_redis
    from batchgen.monitoring.snapshot import snapshot
    from batchgen.registry import get_registry

    registry, client = get_registry(), get_redis()
    with session_scope() as session:
        state = snapshot(session, client, registry, get_settings())
    for model in state["models"]:
        model["rate_limited"] = int(
            counters.read(client, model["model"]).get(counters.RATE_LIMITED, 0)
        )
    today = dt.datetime.now(dt.UTC).date().isoformat()
    usage = python_api.usage(tenant=None, start=today, end=today, group_by="tenant")
    return {"models": state["models"], "usage": usage, "today": today}


def _login_page(error: str | None = None, status: int = 200) -> Response:
    return Response(render_template("dashboard_login.html", error=error), status=status)


@dashboard.get("/dashboard")
def page() -> Response:
    tenant = _tenant()
    if tenant is None:
        return _login_page()
    key = _key()
    assert key is not None
    return Response(
        render_template(
            "dashboard.html",
            view=_view(tenant),
            csrf=csrf_token(key),
            refresh_ms=REFRESH_MS,
            message=request.args.get("message"),
        )
    )


@dashboard.get("/dashboard/fragment")
def fragment() -> Response:
    tenant = _tenant()
    if tenant is None:
        return Response("", status=401)
    key = _key()
    assert key is not None
    return Response(
        render_template("dashboard_tables.html", view=_view(tenant), csrf=csrf_token(key))
    )


@dashboard.post("/dashboard/login")
def login() -> BaseResponse:
    key = request.form.get("key", "").strip()
    try:
        with session_scope() as session:
            tenants.authenticate(session, key)
    except Unauthorized as exc:
        return _login_page(str(exc), 401)
    response = redirect(url_for("dashboard.page"))
    response.set_cookie(
        COOKIE, key, httponly=True, samesite="Strict", secure=request.is_secure, path="/"
    )
    return response


@dashboard.post("/dashboard/logout")
def logout() -> BaseResponse:
    response = redirect(url_for("dashboard.page"))
    response.delete_cookie(COOKIE, path="/")
    return response


def _back(message: str) -> BaseResponse:
    return redirect(url_for("dashboard.page", message=message))


@dashboard.post("/dashboard/submit")
def submit() -> BaseResponse:
    tenant = _tenant()
    if tenant is None:
        return _login_page("sign in again", 401)
    limit = get_settings().max_body_bytes
    try:
        # Capped before the form is parsed: the upload spools at most this, then a 413.
        cap_body(limit + MULTIPART_SLACK_BYTES, f"file larger than {limit} bytes")
        with refused_over():
            signed = _csrf_ok()
            upload = request.files.get("file")
    except PayloadTooLarge as exc:
        return _refused(exc)
    if not signed:
        return _login_page("sign in again", 401)
    if upload is None or not upload.filename:
        return _back("choose a JSONL file of requests")
    try:
        batch = python_api.submit_batch(
            iter(upload.stream.readline, b""),
            tenant=tenant,
            completion_window=request.form.get("completion_window") or None,
            priority=request.form.get("priority") or "interactive",
        )
    except BatchgenError as exc:
        return _back(f"not submitted: {exc}")
    return _back(f"submitted {batch['request_counts']['total']} requests as {batch['id']}")


@dashboard.post("/dashboard/batches/<batch_id>/cancel")
def cancel(batch_id: str) -> BaseResponse:
    tenant = _tenant()
    if tenant is None or not _csrf_ok():
        return _login_page("sign in again", 401)
    try:
        python_api.cancel_batch(batch_id, tenant=tenant)
    except BatchgenError as exc:
        return _back(f"not cancelled: {exc}")
    return _back(f"cancelled {batch_id}")


@dashboard.get("/dashboard/batches/<batch_id>/results.jsonl")
def download(batch_id: str) -> Response:
    import json

    tenant = _tenant()
    if tenant is None:
        return Response("", status=401)

    def lines() -> Iterator[bytes]:
        for row in python_api.iter_results(batch_id, tenant=tenant):
            yield json.dumps(row, ensure_ascii=False).encode() + b"\n"

    python_api.get_batch(batch_id, tenant=tenant)  # 404 before the stream starts
    return Response(
        lines(),
        mimetype="application/jsonl",
        headers={"Content-Disposition": f'attachment; filename="{batch_id}-results.jsonl"'},
    )
