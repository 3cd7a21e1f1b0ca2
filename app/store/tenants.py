"""Tenants: made (with a first API key, :mod:`batchgen.store.api_keys`), changed,
suspended and resumed."""

from __future__ import annotations

import base64
import secrets
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from batchgen.domain.keys import ALL_SCOPES
from batchgen.domain.notifications import check_webhook_url
from batchgen.errors import Conflict, NotFound, ValidationFailed
from batchgen.store import api_keys
from batchgen.store.schema import Tenant

# What an operator may change on a tenant, and the bounds of each (None: no limit).
LIMITS = (
    "max_pending_items",
    "daily_token_quota",
    "tokens_per_min",
    "max_files",
    "max_file_bytes",
)
SETTABLE = ("weight", *LIMITS, "is_admin")


def new_webhook_secret() -> str:
    """A Standard Webhooks secret: ``whsec_`` and 32 random bytes in base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def set_webhook(
    session: Session, name: str, url: str | None = None, *, rotate: bool = False
) -> tuple[str | None, str]:
    """Set a tenant's webhook URL (None: leave it), give it a secret if it has none (or
    a new one with ``rotate``); returns ``(url, secret)``."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}")
    if url is not None:
        tenant.webhook_url = check_webhook_url(url)
    if rotate or not tenant.webhook_secret:
        tenant.webhook_secret = new_webhook_secret()
    return tenant.webhook_url, tenant.webhook_secret


def create_tenant(
    session: Session,
    name: str,
    *,
    weight: int = 1,
    max_pending_items: int | None = None,
    daily_token_quota: int | None = None,
    tokens_per_min: int | None = None,
    is_admin: bool = False,
    webhook_url: str | None = None,
    max_files: int | None = None,
    max_file_bytes: int | None = None,
) -> tuple[Tenant, str]:
    """Create a tenant and its first API key, named ``default`` with every scope;
    returns the tenant and that key (the only time it is visible). Its webhook secret
    (``tenant.webhook_secret``) signs every webhook delivery of its batches' ends
    (``webhook_url``: where they go unless a batch names its own)."""
    name = name.strip() if isinstance(name, str) else ""
    if not name or len(name) > 200:
        raise ValidationFailed("a tenant name needs 1 to 200 characters", field="name")
    tenant = Tenant(
        name=name,
        weight=1,
        is_admin=False,
        webhook_url=check_webhook_url(webhook_url),
        webhook_secret=new_webhook_secret(),
    )
    set_limits(
        tenant,
        {
            "weight": weight,
            "max_pending_items": max_pending_items,
            "daily_token_quota": daily_token_quota,
            "tokens_per_min": tokens_per_min,
            "max_files": max_files,
            "max_file_bytes": max_file_bytes,
            "is_admin": is_admin,
        },
    )
    session.add(tenant)
    try:
        with session.begin_nested():
            session.flush()
    except IntegrityError as exc:
        raise Conflict(f"a tenant named {name!r} already exists", field="name") from exc
    _, secret = api_keys.create(session, tenant, "default", scopes=list(ALL_SCOPES))
    return tenant, secret


def set_limits(tenant: Tenant, changes: dict[str, Any]) -> None:
    """Apply ``changes`` (names of :data:`SETTABLE`) to ``tenant``, each checked."""
    for field, value in changes.items():
        if field not in SETTABLE:
            raise ValidationFailed(
                f"{field!r} cannot be set: settable are {', '.join(SETTABLE)}", field=field
            )
        if field == "is_admin":
            if not isinstance(value, bool):
                raise ValidationFailed("is_admin must be true or false", field=field)
        elif field == "weight":
            if not _whole(value) or value < 1:
                raise ValidationFailed("weight must be an integer of at least 1", field=field)
        elif value is not None and (not _whole(value) or value < 1):
            raise ValidationFailed(f"{field} must be a positive integer or null", field=field)
        setattr(tenant, field, value)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def describe(tenant: Tenant) -> dict[str, Any]:
    """A tenant as the admin API shows it (its webhook secret left out)."""
    return {
        "id": tenant.id,
        "object": "tenant",
        "name": tenant.name,
        **{field: getattr(tenant, field) for field in SETTABLE},
        "webhook_url": tenant.webhook_url,
        "suspended": tenant.revoked_at is not None,
        "suspended_at": tenant.revoked_at.isoformat() if tenant.revoked_at else None,
        "created_at": tenant.created_at.isoformat() if tenant.created_at else None,
    }


def find(session: Session, tenant: str | Tenant) -> Tenant:
    """The tenant named ``tenant`` (or ``tenant`` itself, read in this session);
    :class:`NotFound` when there is none."""
    if isinstance(tenant, Tenant):
        found = session.get(Tenant, tenant.id)
    elif "\x00" in tenant:  # no stored name has one; PostgreSQL would refuse the query
        found = None
    else:
        found = session.scalar(select(Tenant).where(Tenant.name == tenant))
    if found is None:
        raise NotFound(f"no tenant named {tenant!r}")
    return found


def get_active(session: Session, tenant_id: int) -> Tenant | None:
    """The tenant with this id, None if there is none or it is suspended."""
    tenant = session.get(Tenant, tenant_id)
    return tenant if tenant is not None and tenant.revoked_at is None else None


def revoke(session: Session, name: str) -> None:
    """Suspend a tenant: none of its keys works (401); its batches stay."""
    tenant = find(session, name)
    if tenant.revoked_at is None:
        tenant.revoked_at = api_keys.now(session)


def resume(session: Session, name: str) -> None:
    """Lift a tenant's suspension: its keys that are not revoked or expired work again."""
    find(session, name).revoked_at = None


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.id)))


def attach(session: Session, tenant: Tenant) -> Tenant:
    """A tenant row read by another session, attached to ``session`` as it is (no
    query: the row is not read again)."""
    return session.merge(tenant, load=False)
