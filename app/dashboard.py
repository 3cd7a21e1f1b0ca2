"""The batch dashboard: server-rendered pages under ``/dashboard``, behind the same
API keys, with no build step.

- A tenant sees its batches: progress, counts by status, error codes, a download of
  the results, cancel; and submits a JSONL file.
- An admin key also sees, per model, the backlog, slots, budget use and provider
  429s, and per tenant today's usage and cost.

The page refreshes its tables live: a few lines of script fetch the server-rendered
fragment (``/dashboard/fragment``) every ``REFRESH_MS`` and swap it in. Signing in
opens a server-side session (:mod:`batchgen.dashboard_auth`: the cookie, login CSRF,
the sign-in limit, anti-framing headers); every form that changes something carries
a token derived from the session (``csrf``), so another site cannot post them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

from flask import (
    Blueprint,
    Response,
    redirect,
    render_template,
    request,
    stream_with_context,
    url_for,
)
from werkzeug.wrappers import Response as BaseResponse

from batchgen import dashboard_auth as auth
from batchgen import python_api
from batchgen.bodies import (
    MULTIPART_SLACK_BYTES,
    cap_body,
    close_if_unread,
    read_body,
    refused_over,
)
from batchgen.config import get_settings
from batchgen.domain import keys as key_rules
from batchgen.errors import BatchgenError, PayloadTooLarge, Unauthorized
from batchgen.monitoring.dashboard_display import format_usd
from batchgen.python_api import Tenant

# Namespaced (blueprint and templates): a host app's own ``dashboard`` blueprint or
# ``templates/dashboard.html`` does not collide with or replace batchgen's.
dashboard = Blueprint("batchgen_dashboard", __name__, template_folder="templates")

REFRESH_MS = 2000
LIST_LIMIT = 50
csrf_token = auth.csrf_token


@dashboard.after_request
def _secure(response: Response) -> Response:
    return auth.secure(response)


# A dashboard form (sign-in, cancel) is a few short fields: its body is read no further.
FORM_MAX_BYTES = 64 * 1024


@dashboard.before_request
def _cap_forms() -> BaseResponse | None:
    """Read a dashboard form under its cap before a view parses it (Werkzeug reads a
    URL-encoded form whole); the upload has its own cap, set once its cookie is checked."""
    if request.endpoint == "batchgen_dashboard.submit" or request.method != "POST":
        return None
    try:
        read_body(FORM_MAX_BYTES, f"form larger than {FORM_MAX_BYTES} bytes")
    except PayloadTooLarge as exc:
        return _refused(exc)
    return None


def _refused(exc: PayloadTooLarge) -> BaseResponse:
    return close_if_unread(Response(str(exc), status=413, mimetype="text/plain"))


def _tenant() -> Tenant | None:
    return auth.current_tenant()


def _key() -> str | None:
    """The session token the forms' CSRF tokens derive from."""
    return auth.session_token()


def _csrf_ok() -> bool:
    return auth.csrf_ok(request.form.get("csrf", ""))


def _view(tenant: Tenant) -> dict[str, Any]:
    """Everything the page shows for this key: its batches (an admin key: every
    tenant's), the charts, and for an admin the models and today's cost per tenant."""
    usage: list[dict[str, Any]] = []
    view: dict[str, Any] = {"tenant": tenant.name, "admin": tenant.is_admin}
    if tenant.is_admin:
        view.update(_admin_view())
        usage = view["usage"]
    view.update(python_api.dashboard_batches(tenant, LIST_LIMIT, usage))
    return view


def _admin_view() -> dict[str, Any]:
    from batchgen.limits import counters
    from batchgen.limits.backend import get_redis

    client = get_redis()
    state = python_api.status_snapshot()
    for model in state["models"]:
        model["rate_limited"] = int(
            counters.read(client, model["model"]).get(counters.RATE_LIMITED, 0)
        )
    today = dt.datetime.now(dt.UTC).date().isoformat()
    usage = python_api.usage(tenant=None, start=today, end=today, group_by="tenant")
    for row in usage:
        row["money"] = {k: format_usd(row[k]) for k in ("cost_usd", "wasted_cost_usd", "saved_usd")}
    return {"models": state["models"], "usage": usage, "today": today}


def _login_page(
    error: str | None = None, status: int = 200, retry_after_s: int | None = None
) -> Response:
    token, new = auth.signin_token()
    response = Response(
        render_template("batchgen/dashboard_login.html", error=error, signin_csrf=token),
        status=status,
    )
    if new:
        auth.remember_signin_token(response, token)
    if retry_after_s is not None:
        response.headers["Retry-After"] = str(retry_after_s)
    return response


def _operator_view(name: str) -> dict[str, Any]:
    """The operator view a trusted host bridge asked for: every model's state, every
    tenant's batches and usage today; nothing to change (no tenant to submit or cancel
    as)."""
    view: dict[str, Any] = {"tenant": f"{name} (operator)", "admin": True, "operator": True}
    view.update(_admin_view())
    view.update(python_api.dashboard_batches(None, LIST_LIMIT, view["usage"]))  # read only
    return view


def _operator_page(name: str) -> Response:
    return Response(
        render_template(
            "batchgen/dashboard.html",
            view=_operator_view(name),
            csrf="",
            refresh_ms=REFRESH_MS,
            message=None,
        )
    )


@dashboard.get("/dashboard")
def page() -> Response:
    tenant = _tenant()
    if tenant is None:
        operator = auth.operator()
        return _operator_page(operator) if operator else _login_page()
    key = _key()
    assert key is not None
    return Response(
        render_template(
            "batchgen/dashboard.html",
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
        operator = auth.operator()
        if operator:
            view = _operator_view(operator)
            return Response(render_template("batchgen/dashboard_tables.html", view=view, csrf=""))
        return Response("", status=401)
    key = _key()
    assert key is not None
    return Response(
        render_template("batchgen/dashboard_tables.html", view=_view(tenant), csrf=csrf_token(key))
    )


@dashboard.post("/dashboard/login")
def login() -> BaseResponse:
    key = request.form.get("key", "").strip()
    try:
        auth.check_signin(key)
        caller = python_api.authenticate(key)  # its tenant comes back detached
        tenant = caller.tenant
        key_rules.check_dashboard_scopes(caller.scopes)
    except auth.SigninRefused as refused:
        return _login_page(refused.message, refused.status, refused.retry_after_s)
    except Unauthorized as exc:
        return _login_page(str(exc), 401)
    except key_rules.KeyOutOfScope as exc:
        return _login_page(str(exc), 403)
    response = redirect(url_for(".page"))
    auth.start_session(response, tenant, caller.key_id)
    return response


@dashboard.post("/dashboard/logout")
def logout() -> BaseResponse:
    response = redirect(url_for(".page"))
    if auth.same_origin():  # another site's post signs nobody out
        auth.end_session(response)
    return response


def _back(message: str) -> BaseResponse:
    return redirect(url_for("batchgen_dashboard.page", message=message))


@dashboard.post("/dashboard/submit")
def submit() -> BaseResponse:
    tenant = _tenant()
    if tenant is None:
        return _login_page("sign in again", 401)
    limit = get_settings().submit.max_body_bytes
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
    """Cancel, once confirmed: a post without ``confirm=yes`` (a form of an older page)
    gets the confirmation page instead, so no single click cancels a batch."""
    tenant = _tenant()
    if tenant is None or not _csrf_ok():
        return _login_page("sign in again", 401)
    if request.form.get("confirm") != "yes":
        return _batch_view(tenant, batch_id, "batchgen/dashboard_cancel.html")
    try:
        python_api.cancel_batch(batch_id, tenant=tenant)
    except BatchgenError as exc:
        return _back(f"not cancelled: {exc}")
    return _back(f"cancelled {batch_id}")


@dashboard.get("/dashboard/batches/<batch_id>/cancel")
def confirm_cancel(batch_id: str) -> Response:
    """The question before a cancel (it changes nothing): the batch's progress, what
    cancelling does, and the form that does it; no script needed."""
    tenant = _tenant()
    if tenant is None:
        return _login_page()
    return _batch_view(tenant, batch_id, "batchgen/dashboard_cancel.html")


@dashboard.get("/dashboard/batches/<batch_id>")
def batch_page(batch_id: str) -> Response:
    """One batch: counts and progress by status, rate and time left, tokens, cost,
    errors by code; a tenant's own batches only (404 for another's), any for an admin."""
    tenant = _tenant()
    if tenant is None:
        return _login_page()
    return _batch_view(tenant, batch_id, "batchgen/dashboard_batch.html")


def _batch_view(tenant: Tenant, batch_id: str, template: str) -> Response:
    """A page of one batch the tenant may read (404 for another's)."""
    from batchgen.errors import NotFound

    key = _key()
    assert key is not None
    try:
        batch = python_api.dashboard_batch(tenant, batch_id)
    except NotFound as exc:
        return Response(
            render_template("batchgen/dashboard_missing.html", message=str(exc)), status=404
        )
    return Response(
        render_template(
            template,
            view={"tenant": tenant.name, "admin": tenant.is_admin},
            b=batch,
            csrf=csrf_token(key),
        )
    )


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
        stream_with_context(lines()),
        mimetype="application/jsonl",
        headers={"Content-Disposition": f'attachment; filename="{batch_id}-results.jsonl"'},
    )
