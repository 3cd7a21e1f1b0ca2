"""A tenant's API keys (``api_keys``): made, found by hash, rotated, revoked.

A key's secret is shown once, when it is made; only its SHA-256 and its first
characters are kept. Authenticating is one lookup by the hash's unique index (with
its tenant); its last use is written at most once a minute per key, by a
conditional UPDATE that a concurrent twin skips (it never waits for the row).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select
from sqlalchemy.orm import Session, make_transient_to_detached

from batchgen.domain import keys as rules
from batchgen.errors import NotFound, Unauthorized, ValidationFailed
from batchgen.store import db
from batchgen.store.schema import ApiKey, Tenant
from batchgen.store.sqlfiles import driver_query


def hash_key(secret: str) -> str:
    """SHA-256 of a key. Keys carry 256 random bits, so a fast hash is enough."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_secret() -> str:
    return rules.SECRET_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Caller:
    """Who a request's key says it is: the key's id, name and scopes, its own rate
    limit, and its tenant (a detached row)."""

    key_id: int
    key_name: str
    scopes: tuple[str, ...]
    requests_per_min: int | None
    tenant: Tenant
    # Whether a dollar budget applies to its calls (its tenant's or its own), read in
    # the same lookup: a call with none reserves nothing and reads nothing more.
    has_budget: bool = True


def now(session: Session) -> dt.datetime:
    found = session.scalar(select(func.now()))
    assert found is not None
    return found


def create(
    session: Session,
    tenant: Tenant,
    name: str,
    *,
    scopes: list[str] | str | None = None,
    expires_at: dt.datetime | None = None,
    requests_per_min: int | None = None,
    rotated_from: int | None = None,
) -> tuple[ApiKey, str]:
    """A new key of ``tenant``; returns its row and its secret (the only time it is seen)."""
    name = (name or "").strip()
    if not name or len(name) > 200:
        raise ValidationFailed("a key needs a name of 1 to 200 characters", field="name")
    check_rate(requests_per_min)
    secret = new_secret()
    key = ApiKey(
        tenant_id=tenant.id,
        name=name,
        key_hash=hash_key(secret),
        key_prefix=rules.shown_prefix(secret),
        scopes=rules.parse_scopes(scopes),
        expires_at=expires_at,
        requests_per_min=requests_per_min,
        rotated_from=rotated_from,
    )
    session.add(key)
    session.flush()
    return key, secret


def check_rate(requests_per_min: Any) -> None:
    if requests_per_min is not None and (
        not isinstance(requests_per_min, int)
        or isinstance(requests_per_min, bool)
        or requests_per_min < 1
    ):
        raise ValidationFailed(
            "requests_per_min must be a positive integer or null", field="requests_per_min"
        )


def authenticate(connection: Session | Connection, secret: str | None) -> Caller:
    """The key ``secret`` is and its tenant; :class:`Unauthorized` when it is missing,
    unknown, revoked or expired, or its tenant is suspended. Notes its use (at most
    once per :data:`~batchgen.domain.keys.LAST_USED_EVERY_S` per key).

    One statement for the key and its tenant (``sql/key_caller.sql``), through the
    driver: the tenant comes back as a detached row, as a session's would after it
    closed. Nothing is cached, so a revoked key is refused from its next request on."""
    if not secret:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    rows = db.driver_rows(connection, driver_query("key_caller"), {"key_hash": hash_key(secret)})
    if not rows:
        raise Unauthorized("unknown API key")
    (row,) = rows
    at = row.key_checked_at
    refused = rules.refusal(at, row.key_expires_at, row.key_revoked_at)
    if refused is not None:
        raise Unauthorized(refused)
    if row.revoked_at is not None:
        raise Unauthorized("this API key's tenant is suspended")
    if rules.last_used_due(at, row.key_last_used_at):
        stale = at - dt.timedelta(seconds=rules.LAST_USED_EVERY_S)
        params = {"key_id": row.key_id, "at": at, "stale": stale}
        db.driver_rows(connection, driver_query("key_touch"), params)
    scopes = tuple(row.key_scopes or ())
    return Caller(
        row.key_id,
        row.key_name,
        scopes,
        row.key_requests_per_min,
        _tenant_of(row),
        bool(row.key_has_budget),
    )


def _tenant_of(row: Any) -> Tenant:
    """The tenant's columns of a ``key_caller`` row as a detached :class:`Tenant`."""
    tenant = Tenant(**{c.key: getattr(row, c.name) for c in _TENANT_COLUMNS})
    make_transient_to_detached(tenant)
    return tenant


_TENANT_COLUMNS = tuple(Tenant.__table__.columns)


def works(session: Session, key_id: int) -> bool:
    """Whether the key ``key_id`` works now (not revoked, not expired)."""
    row = session.execute(
        select(ApiKey.expires_at, ApiKey.revoked_at, func.now()).where(ApiKey.id == key_id)
    ).one_or_none()
    return row is not None and rules.refusal(row[2], row[0], row[1]) is None


def of_tenant(session: Session, tenant_id: int) -> list[ApiKey]:
    """The tenant's keys, revoked and expired ones too, oldest first."""
    return list(
        session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.id))
    )


def get(session: Session, tenant_id: int, key_id: Any, *, lock: bool = False) -> ApiKey:
    """The tenant's key ``key_id``; :class:`NotFound` for another tenant's or none."""
    try:
        wanted = int(key_id)
    except (TypeError, ValueError):
        raise NotFound(f"no API key {key_id!r}") from None
    query = select(ApiKey).where(ApiKey.id == wanted, ApiKey.tenant_id == tenant_id)
    if lock:
        query = query.with_for_update()
    key = session.scalar(query)
    if key is None:
        raise NotFound(f"no API key {key_id!r} of this tenant")
    return key


def describe(key: ApiKey, at: dt.datetime | None = None) -> dict[str, Any]:
    """A key as the APIs show it: never its secret nor its hash."""
    state = "active"
    if at is not None:
        refused = rules.refusal(at, key.expires_at, key.revoked_at)
        state = "active" if refused is None else ("revoked" if "revoked" in refused else "expired")
    elif key.revoked_at is not None:
        state = "revoked"
    return {
        "id": key.id,
        "object": "api_key",
        "name": key.name,
        "prefix": key.key_prefix,
        "scopes": list(key.scopes),
        "requests_per_min": key.requests_per_min,
        "expires_at": _iso(key.expires_at),
        "revoked_at": _iso(key.revoked_at),
        "last_used_at": _iso(key.last_used_at),
        "rotated_from": key.rotated_from,
        "created_at": _iso(key.created_at),
        "state": state,
    }


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
