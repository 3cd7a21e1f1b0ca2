"""The admin API (Flask blueprint ``batchgen_admin``): operators manage tenants, their
quotas and weights, and their keys over JSON at ``/admin/v1/...``, and read the audit
log; a tenant manages its own keys at ``/v1/keys`` with a key of scope ``admin``.

Who may call ``/admin/v1``: an operator key (``Authorization: Bearer``), one of the
hashes of ``BATCHGEN_ADMIN_KEYS``; or, in Django, a signed-in active staff user (the
bridge says so in the WSGI environ, which no request can set). Any tenant key, even
one with the ``admin`` scope or of an ``is_admin`` tenant, gets 403
``operator_key_required``; none, 401. The body is read only after that.
Every change is a row of the audit log, written in the change's transaction.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from flask import Blueprint, Response, g, jsonify, request

from batchgen import python_api, tenant_admin
from batchgen.bodies import close_if_unread, json_body
from batchgen.config import get_settings
from batchgen.dashboard_auth import OPERATOR_ENVIRON_KEY
from batchgen.errors import Forbidden, Unauthorized, ValidationFailed
from batchgen.request_auth import api_key, current_key

admin_blueprint = Blueprint("batchgen_admin", __name__)
admin_blueprint.after_request(close_if_unread)
# The largest admin request body (a tenant's or a key's fields).
MAX_ADMIN_BODY_BYTES = 64 * 1024


class OperatorKeyRequired(Forbidden):
    """A working tenant key on the operators' API (403)."""

    code = "operator_key_required"


def operator_of(presented: str, entries: list[str]) -> str | None:
    """The name of the operator key ``presented`` is, among ``entries``
    (``<name>:<sha256>``), compared in constant time; None if it is none of them."""
    digest = hashlib.sha256(presented.encode("utf-8")).hexdigest().encode()
    found = None
    for entry in entries:
        name, _, expected = entry.rpartition(":")
        if hmac.compare_digest(digest, expected.encode()):
            found = name
    return found


def _operator() -> str:
    """Who the operator is (the audit's actor), or 401 / 403."""
    if "operator" in g:
        actor: str = g.operator
        return actor
    staff = request.environ.get(OPERATOR_ENVIRON_KEY)
    if isinstance(staff, str) and staff:
        g.operator = f"django:{staff}"
        return str(g.operator)
    presented = api_key()
    if presented is None:
        raise Unauthorized("the admin API needs 'Authorization: Bearer <operator key>'")
    name = operator_of(presented, get_settings().api.admin_keys)
    if name is None:
        python_api.authenticate(presented)  # 401 for no key of ours at all
        raise OperatorKeyRequired(
            "a tenant's API key cannot use the admin API: it needs an operator key "
            "(BATCHGEN_ADMIN_KEYS)"
        )
    g.operator = f"operator:{name}"
    return str(g.operator)


@admin_blueprint.before_request
def _authenticate() -> None:
    """Every /admin/v1 request is an operator's, before anything is read."""
    if request.endpoint and request.endpoint.startswith("batchgen_admin.admin_"):
        _operator()


def _body() -> dict[str, Any]:
    body = json_body(MAX_ADMIN_BODY_BYTES)
    if body is None and not request.get_data(cache=True):
        return {}
    if not isinstance(body, dict):
        raise ValidationFailed("the body must be a JSON object")
    return body


def _int_arg(name: str, default: int | None) -> int | None:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValidationFailed(f"{name} must be an integer", field=name) from exc


def _key_fields(body: dict[str, Any]) -> dict[str, Any]:
    unknown = set(body) - {"name", "scopes", "expires_at", "expires_in_s", "requests_per_min"}
    if unknown:
        raise ValidationFailed(f"unknown fields: {', '.join(sorted(unknown))}")
    if not isinstance(body.get("name", "key"), str):
        raise ValidationFailed("name must be a string", field="name")
    return {
        "name": body.get("name", "key"),
        "scopes": body.get("scopes"),
        "expires_at": body.get("expires_at"),
        "expires_in_s": body.get("expires_in_s"),
        "requests_per_min": body.get("requests_per_min"),
    }


def _overlap_s(body: dict[str, Any]) -> float | None:
    overlap = body.get("overlap_s")
    if overlap is not None and (not isinstance(overlap, int | float) or isinstance(overlap, bool)):
        raise ValidationFailed("overlap_s must be a number of seconds", field="overlap_s")
    return overlap


def _list(data: list[dict[str, Any]]) -> Response:
    return jsonify({"object": "list", "data": data})


# -- tenants -------------------------------------------------------------------


@admin_blueprint.get("/admin/v1/tenants")
def admin_list_tenants() -> Response:
    return _list(tenant_admin.list_tenants())


@admin_blueprint.post("/admin/v1/tenants")
def admin_create_tenant() -> tuple[Response, int]:
    body = _body()
    name = body.pop("name", None)
    if not isinstance(name, str):
        raise ValidationFailed("name (a string) is required", field="name")
    allowed = {"weight", "webhook_url", "is_admin", *python_api.TENANT_LIMITS}
    unknown = set(body) - allowed
    if unknown:
        raise ValidationFailed(f"unknown fields: {', '.join(sorted(unknown))}")
    if not isinstance(body.get("webhook_url") or "", str):
        raise ValidationFailed("webhook_url must be a string", field="webhook_url")
    weight = body.pop("weight", 1)
    made = tenant_admin.create_tenant(name, actor=_operator(), **body, weight=weight)
    return jsonify(made), 201


@admin_blueprint.get("/admin/v1/tenants/<name>")
def admin_get_tenant(name: str) -> Response:
    return jsonify(tenant_admin.get_tenant(name))


@admin_blueprint.patch("/admin/v1/tenants/<name>")
def admin_update_tenant(name: str) -> Response:
    return jsonify(tenant_admin.update_tenant(name, _body(), actor=_operator()))


@admin_blueprint.post("/admin/v1/tenants/<name>/suspend")
def admin_suspend_tenant(name: str) -> Response:
    return jsonify(tenant_admin.suspend_tenant(name, actor=_operator()))


@admin_blueprint.post("/admin/v1/tenants/<name>/resume")
def admin_resume_tenant(name: str) -> Response:
    return jsonify(tenant_admin.resume_tenant(name, actor=_operator()))


# -- keys ----------------------------------------------------------------------


@admin_blueprint.get("/admin/v1/tenants/<name>/keys")
def admin_list_keys(name: str) -> Response:
    return _list(tenant_admin.list_keys(name))


@admin_blueprint.post("/admin/v1/tenants/<name>/keys")
def admin_create_key(name: str) -> tuple[Response, int]:
    return jsonify(tenant_admin.create_key(name, actor=_operator(), **_key_fields(_body()))), 201


@admin_blueprint.patch("/admin/v1/tenants/<name>/keys/<key_id>")
def admin_update_key(name: str, key_id: str) -> Response:
    return jsonify(tenant_admin.update_key(name, key_id, _body(), actor=_operator()))


@admin_blueprint.post("/admin/v1/tenants/<name>/keys/<key_id>/rotate")
def admin_rotate_key(name: str, key_id: str) -> tuple[Response, int]:
    overlap_s = _overlap_s(_body())
    return jsonify(
        tenant_admin.rotate_key(name, key_id, overlap_s=overlap_s, actor=_operator())
    ), 201


@admin_blueprint.post("/admin/v1/tenants/<name>/keys/<key_id>/revoke")
@admin_blueprint.delete("/admin/v1/tenants/<name>/keys/<key_id>")
def admin_revoke_key(name: str, key_id: str) -> Response:
    return jsonify(tenant_admin.revoke_key(name, key_id, actor=_operator()))


# -- dollar budgets (docs/money.md) ---------------------------------------------

BUDGET_FIELDS = {"limit_usd", "period", "time_zone", "thresholds", "key_id"}


@admin_blueprint.get("/admin/v1/tenants/<name>/budgets")
def admin_list_budgets(name: str) -> Response:
    return _list(tenant_admin.get_budgets(name))


@admin_blueprint.put("/admin/v1/tenants/<name>/budget")
def admin_set_budget(name: str) -> Response:
    body = _body()
    unknown = set(body) - BUDGET_FIELDS
    if unknown:
        raise ValidationFailed(f"unknown fields: {', '.join(sorted(unknown))}")
    if "limit_usd" not in body:
        raise ValidationFailed("limit_usd is required", field="limit_usd")
    thresholds = body.get("thresholds")
    if thresholds is not None and not isinstance(thresholds, list):
        raise ValidationFailed("thresholds must be a list of per cents", field="thresholds")
    return jsonify(
        tenant_admin.set_budget(
            name,
            limit_usd=body["limit_usd"],
            period=body.get("period", "month"),
            time_zone=body.get("time_zone", "UTC"),
            thresholds=thresholds,
            key_id=body.get("key_id"),
            actor=_operator(),
        )
    )


@admin_blueprint.delete("/admin/v1/tenants/<name>/budget")
def admin_delete_budget(name: str) -> Response:
    return jsonify(
        tenant_admin.delete_budget(name, key_id=request.args.get("key_id"), actor=_operator())
    )


# -- audit log -----------------------------------------------------------------


@admin_blueprint.get("/admin/v1/audit")
def admin_audit_log() -> Response:
    entries = tenant_admin.audit_log(
        tenant=request.args.get("tenant"),
        limit=_int_arg("limit", 100) or 100,
        before_id=_int_arg("before", None),
    )
    return _list(entries)


# -- a tenant's own keys (scope admin) -----------------------------------------


def _own() -> tuple[Any, str]:
    """The calling key's tenant and the audit's actor for it (scope ``admin``)."""
    caller = current_key()
    return caller.tenant, f"tenant:{caller.tenant.name}/key:{caller.key_id}"


@admin_blueprint.get("/v1/keys")
def list_own_keys() -> Response:
    tenant, _ = _own()
    return _list(tenant_admin.list_keys(tenant))


@admin_blueprint.post("/v1/keys")
def create_own_key() -> tuple[Response, int]:
    tenant, actor = _own()
    return jsonify(tenant_admin.create_key(tenant, actor=actor, **_key_fields(_body()))), 201


@admin_blueprint.post("/v1/keys/<key_id>/rotate")
def rotate_own_key(key_id: str) -> tuple[Response, int]:
    tenant, actor = _own()
    overlap_s = _overlap_s(_body())
    return jsonify(tenant_admin.rotate_key(tenant, key_id, overlap_s=overlap_s, actor=actor)), 201


@admin_blueprint.delete("/v1/keys/<key_id>")
def revoke_own_key(key_id: str) -> Response:
    tenant, actor = _own()
    return jsonify(tenant_admin.revoke_key(tenant, key_id, actor=actor))
