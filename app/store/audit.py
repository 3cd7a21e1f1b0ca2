"""The audit log (``audit_log``): one row per change to a tenant or a key, written in
the change's own transaction, so a change and its record stand or fall together."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchgen.errors import ValidationFailed
from batchgen.store.schema import AuditEntry, Tenant

MAX_PAGE = 500


def record(
    session: Session,
    actor: str,
    action: str,
    *,
    tenant_id: int | None,
    key_id: int | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> None:
    """Add a row; ``before`` / ``after`` are the described rows (no secret, no hash)."""
    session.add(
        AuditEntry(
            actor=actor[:300],
            action=action,
            tenant_id=tenant_id,
            key_id=key_id,
            before=before,
            after=after,
        )
    )


def entries(
    session: Session,
    *,
    tenant_id: int | None = None,
    limit: int = 100,
    before_id: int | None = None,
) -> list[dict[str, Any]]:
    """The newest rows first (of one tenant, or all), ``limit`` of them, older than
    ``before_id`` (to page back)."""
    if not 1 <= limit <= MAX_PAGE:
        raise ValidationFailed(f"limit must be between 1 and {MAX_PAGE}", field="limit")
    query = (
        select(AuditEntry, Tenant.name)
        .outerjoin(Tenant, Tenant.id == AuditEntry.tenant_id)
        .order_by(AuditEntry.id.desc())
        .limit(limit)
    )
    if tenant_id is not None:
        query = query.where(AuditEntry.tenant_id == tenant_id)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    return [_describe(entry, name) for entry, name in session.execute(query)]


def _describe(entry: AuditEntry, tenant: str | None) -> dict[str, Any]:
    at: dt.datetime = entry.at
    return {
        "id": entry.id,
        "object": "audit_entry",
        "at": at.isoformat(),
        "actor": entry.actor,
        "action": entry.action,
        "tenant": tenant,
        "key_id": entry.key_id,
        "before": entry.before,
        "after": entry.after,
    }
