"""Tenant and key management for operators, as Python calls: what the admin API
(``/admin/v1``), the CLI and the Django admin run. Each call is one transaction
that makes its change and its audit row together.

``actor`` says who makes the change, as the audit log shows it: ``operator:<name>``
(an operator key of ``BATCHGEN_ADMIN_KEYS``), ``django:<user>``, ``cli:<os user>``,
``tenant:<name>/key:<id>`` (a tenant's own ``admin`` key), or ``python`` (the default).

    from batchgen import tenant_admin

    made = admin.create_tenant("acme", weight=2, actor="python")
    made["api_key"]["secret"]          # shown this once
    admin.rotate_key("acme", made["api_key"]["id"], overlap_s=3600)
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

from sqlalchemy.orm import Session

from batchgen.domain import keys as rules
from batchgen.domain.billing import budget_maths as money_rules
from batchgen.domain.billing.budget_maths import BudgetRule
from batchgen.errors import Conflict, NotFound, ValidationFailed
from batchgen.store import api_keys as keys
from batchgen.store import audit, budget_rows, tenants
from batchgen.store.db import session_scope
from batchgen.store.schema import ApiKey, Tenant
from batchgen.worker import money_settle

DEFAULT_ACTOR = "python"


def _tenant(session: Session, tenant: str | Tenant) -> Tenant:
    return tenants.find(session, tenant)


def create_tenant(
    name: str,
    *,
    actor: str = DEFAULT_ACTOR,
    weight: int = 1,
    max_pending_items: int | None = None,
    daily_token_quota: int | None = None,
    tokens_per_min: int | None = None,
    max_files: int | None = None,
    max_file_bytes: int | None = None,
    is_admin: bool = False,
    webhook_url: str | None = None,
) -> dict[str, Any]:
    """Create a tenant and its first key (``default``, every scope). The answer's
    ``api_key.secret`` is the key: it is never shown again (``webhook_secret``, which
    signs its webhooks, can be read again with ``batchgen tenants webhook``)."""
    with session_scope() as session:
        tenant, secret = tenants.create_tenant(
            session,
            name,
            weight=weight,
            max_pending_items=max_pending_items,
            daily_token_quota=daily_token_quota,
            tokens_per_min=tokens_per_min,
            max_files=max_files,
            max_file_bytes=max_file_bytes,
            is_admin=is_admin,
            webhook_url=webhook_url,
        )
        first = keys.of_tenant(session, tenant.id)[0]
        described = tenants.describe(tenant)
        audit.record(session, actor, "tenant.create", tenant_id=tenant.id, after=described)
        key = keys.describe(first)
        audit.record(session, actor, "key.create", tenant_id=tenant.id, key_id=first.id, after=key)
        return {
            **described,
            "webhook_secret": tenant.webhook_secret,
            "api_key": {**key, "secret": secret},
        }


def list_tenants() -> list[dict[str, Any]]:
    """Every tenant, oldest first."""
    with session_scope() as session:
        return [tenants.describe(t) for t in tenants.list_tenants(session)]


def get_tenant(tenant: str | Tenant) -> dict[str, Any]:
    """One tenant, with its keys."""
    with session_scope() as session:
        found = _tenant(session, tenant)
        at = keys.now(session)
        return {
            **tenants.describe(found),
            "keys": [keys.describe(k, at) for k in keys.of_tenant(session, found.id)],
        }


def update_tenant(
    tenant: str | Tenant, changes: dict[str, Any], *, actor: str = DEFAULT_ACTOR
) -> dict[str, Any]:
    """Set a tenant's ``weight``, quotas (``daily_token_quota``, ``tokens_per_min``,
    ``max_pending_items``, ``max_files``, ``max_file_bytes``; None removes one) or
    ``is_admin``. New admissions and dispatches use them at once."""
    with session_scope() as session:
        found = _tenant(session, tenant)
        before = tenants.describe(found)
        tenants.set_limits(found, changes)
        after = tenants.describe(found)
        if after != before:
            audit.record(
                session, actor, "tenant.update", tenant_id=found.id, before=before, after=after
            )
        return after


def suspend_tenant(tenant: str | Tenant, *, actor: str = DEFAULT_ACTOR) -> dict[str, Any]:
    """Stop every key of the tenant (401) until :func:`resume_tenant`; its batches stay."""
    return _suspension(tenant, actor, suspend=True)


def resume_tenant(tenant: str | Tenant, *, actor: str = DEFAULT_ACTOR) -> dict[str, Any]:
    """Let the tenant's keys work again (those not revoked or expired)."""
    return _suspension(tenant, actor, suspend=False)


def _suspension(tenant: str | Tenant, actor: str, *, suspend: bool) -> dict[str, Any]:
    with session_scope() as session:
        found = _tenant(session, tenant)
        before = tenants.describe(found)
        (tenants.revoke if suspend else tenants.resume)(session, found.name)
        after = tenants.describe(found)
        if after != before:
            action = "tenant.suspend" if suspend else "tenant.resume"
            audit.record(session, actor, action, tenant_id=found.id, before=before, after=after)
        return after


def create_key(
    tenant: str | Tenant,
    *,
    name: str,
    scopes: list[str] | str | None = None,
    expires_at: str | dt.datetime | None = None,
    expires_in_s: float | None = None,
    requests_per_min: int | None = None,
    actor: str = DEFAULT_ACTOR,
) -> dict[str, Any]:
    """A new key of the tenant; the answer's ``secret`` is shown this once. ``scopes``:
    of batches, calls, read, admin (default: all but admin)."""
    with session_scope() as session:
        found = _tenant(session, tenant)
        at = keys.now(session)
        key, secret = keys.create(
            session,
            found,
            name,
            scopes=scopes,
            expires_at=rules.parse_expiry(at, expires_at, expires_in_s),
            requests_per_min=requests_per_min,
        )
        described = keys.describe(key, at)
        audit.record(
            session, actor, "key.create", tenant_id=found.id, key_id=key.id, after=described
        )
        return {**described, "secret": secret}


def list_keys(tenant: str | Tenant) -> list[dict[str, Any]]:
    """The tenant's keys (revoked and expired ones too), never their secrets."""
    with session_scope() as session:
        found = _tenant(session, tenant)
        at = keys.now(session)
        return [keys.describe(k, at) for k in keys.of_tenant(session, found.id)]


def update_key(
    tenant: str | Tenant, key_id: int | str, changes: dict[str, Any], *, actor: str = DEFAULT_ACTOR
) -> dict[str, Any]:
    """Change a key's ``name``, ``scopes`` or ``requests_per_min`` (None: no own limit)."""
    with session_scope() as session:
        found = _tenant(session, tenant)
        at = keys.now(session)
        key = keys.get(session, found.id, key_id, lock=True)
        before = keys.describe(key, at)
        for field, value in changes.items():
            _set_key_field(key, field, value)
        after = keys.describe(key, at)
        if after != before:
            audit.record(
                session,
                actor,
                "key.update",
                tenant_id=found.id,
                key_id=key.id,
                before=before,
                after=after,
            )
        return after


def _set_key_field(key: ApiKey, field: str, value: Any) -> None:
    if field == "name":
        if not isinstance(value, str) or not value.strip() or len(value.strip()) > 200:
            raise ValidationFailed("a key needs a name of 1 to 200 characters", field="name")
        key.name = value.strip()
    elif field == "scopes":
        key.scopes = rules.parse_scopes(value if value is not None else [])
    elif field == "requests_per_min":
        keys.check_rate(value)
        key.requests_per_min = value
    else:
        raise ValidationFailed(
            f"{field!r} cannot be set: settable are name, scopes, requests_per_min", field=field
        )


def rotate_key(
    tenant: str | Tenant,
    key_id: int | str,
    *,
    overlap_s: float | None = None,
    actor: str = DEFAULT_ACTOR,
) -> dict[str, Any]:
    """A new key with the old one's name, scopes and rate limit (``new``, with its
    ``secret`` shown this once); the old one (``old``) keeps working ``overlap_s``
    longer (default a day; 0: it stops now), then expires."""
    with session_scope() as session:
        found = _tenant(session, tenant)
        at = keys.now(session)
        old = keys.get(session, found.id, key_id, lock=True)
        refused = rules.refusal(at, old.expires_at, old.revoked_at)
        if refused is not None:
            raise Conflict(f"key {old.id} cannot be rotated: {refused.removeprefix('this ')}")
        before = keys.describe(old, at)
        new, secret = keys.create(
            session,
            found,
            old.name,
            scopes=list(old.scopes),
            requests_per_min=old.requests_per_min,
            rotated_from=old.id,
        )
        old.expires_at = rules.rotation_expiry(at, old.expires_at, overlap_s)
        old_after = keys.describe(old, at)
        new_after = keys.describe(new, at)
        audit.record(
            session,
            actor,
            "key.rotate",
            tenant_id=found.id,
            key_id=old.id,
            before=before,
            after={"old": old_after, "new": new_after},
        )
        return {"old": old_after, "new": {**new_after, "secret": secret}}


def revoke_key(
    tenant: str | Tenant, key_id: int | str, *, actor: str = DEFAULT_ACTOR
) -> dict[str, Any]:
    """Stop one key now (its next request gets 401); the tenant's other keys go on."""
    with session_scope() as session:
        found = _tenant(session, tenant)
        at = keys.now(session)
        key = keys.get(session, found.id, key_id, lock=True)
        before = keys.describe(key, at)
        if key.revoked_at is None:
            key.revoked_at = at
            after = keys.describe(key, at)
            audit.record(
                session,
                actor,
                "key.revoke",
                tenant_id=found.id,
                key_id=key.id,
                before=before,
                after=after,
            )
            return after
        return before


def audit_log(
    *, tenant: str | Tenant | None = None, limit: int = 100, before_id: int | None = None
) -> list[dict[str, Any]]:
    """The audit log, newest first (of one tenant, or all)."""
    with session_scope() as session:
        tenant_id = None if tenant is None else _tenant(session, tenant).id
        return audit.entries(session, tenant_id=tenant_id, limit=limit, before_id=before_id)


# -- dollar budgets (docs/money.md) ----------------------------------------------------


def set_budget(
    tenant: str | Tenant,
    *,
    limit_usd: Decimal | int | float | str,
    period: str = "month",
    time_zone: str = "UTC",
    thresholds: list[int] | None = None,
    key_id: int | str | None = None,
    actor: str = DEFAULT_ACTOR,
) -> dict[str, Any]:
    """Set (create or replace) the dollar budget of the tenant, or of its key
    ``key_id``: a hard limit of ``limit_usd`` per ``period`` (day, month, total) in
    ``time_zone``, and soft ``thresholds`` in per cent (default 50, 80, 100). It takes
    effect at the next reservation: raising it releases held items at once."""
    rule = _budget_rule(limit_usd, period, time_zone, thresholds)
    with session_scope() as session:
        found = _tenant(session, tenant)
        kid = None if key_id is None else keys.get(session, found.id, key_id).id
        after, before = budget_rows.set_budget(session, found.id, kid, rule)
        audit.record(
            session,
            actor,
            "budget.set",
            tenant_id=found.id,
            key_id=kid,
            before=None if before is None else before.as_dict(),
            after=after.as_dict(),
        )
        result = after.as_dict()
    money_settle.forget_budget_tenants()  # this process settles its calls from now on
    return result


def _budget_rule(
    limit_usd: Any, period: str, time_zone: str, thresholds: list[int] | None
) -> BudgetRule:
    if isinstance(limit_usd, bool) or not isinstance(limit_usd, Decimal | int | float | str):
        raise ValidationFailed("limit_usd must be a number of dollars", field="limit_usd")
    try:
        limit = Decimal(str(limit_usd))
    except ArithmeticError:
        raise ValidationFailed("limit_usd must be a number of dollars", field="limit_usd") from None
    if not limit.is_finite() or limit < 0 or limit > Decimal(10) ** 12:
        raise ValidationFailed("limit_usd must be 0 or more dollars", field="limit_usd")
    if not isinstance(time_zone, str):
        raise ValidationFailed("time_zone must be an IANA zone name", field="time_zone")
    money_rules.zone(time_zone)
    return BudgetRule(
        money_rules.to_micros(limit),
        money_rules.parse_period(period),
        time_zone,
        money_rules.parse_thresholds(thresholds),
    )


def get_budgets(tenant: str | Tenant) -> list[dict[str, Any]]:
    """The tenant's budgets (its own and its keys'), each with what its period has used
    and reserved now and when it resets."""
    from batchgen.worker import money_holds as at_work  # Redis: only when asked

    with session_scope() as session:
        found = _tenant(session, tenant)
        tenant_id = found.id
    return at_work.status(tenant_id)


def delete_budget(
    tenant: str | Tenant, *, key_id: int | str | None = None, actor: str = DEFAULT_ACTOR
) -> dict[str, Any]:
    """Remove the budget of the tenant (or of its key): its calls are no longer capped."""
    with session_scope() as session:
        found = _tenant(session, tenant)
        kid = None if key_id is None else keys.get(session, found.id, key_id).id
        before = budget_rows.delete_budget(session, found.id, kid)
        if before is None:
            raise NotFound("no such budget")
        audit.record(
            session,
            actor,
            "budget.delete",
            tenant_id=found.id,
            key_id=kid,
            before=before.as_dict(),
        )
        return {"deleted": True, **before.as_dict()}
