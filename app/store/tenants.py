"""Tenants and their API keys. Keys are shown once; only a SHA-256 hash is stored."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import secrets

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, make_transient_to_detached

from batchgen.domain.notifications import check_webhook_url
from batchgen.errors import Conflict, NotFound, Unauthorized, ValidationFailed
from batchgen.store import db
from batchgen.store.schema import Tenant

KEY_PREFIX = "bg_"


def hash_key(key: str) -> str:
    """SHA-256 of a key. Keys carry 256 random bits, so a fast hash is enough."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


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
    """Create a tenant; returns it and its API key (the only time the key is visible).
    Its webhook secret (``tenant.webhook_secret``) signs every webhook delivery of its
    batches' ends (``webhook_url``: where they go unless a batch names its own)."""
    name = name.strip()
    if not name:
        raise ValidationFailed("tenant name must not be empty", field="name")
    if weight < 1:
        raise ValidationFailed("weight must be at least 1", field="weight")
    key = new_key()
    tenant = Tenant(
        name=name,
        key_hash=hash_key(key),
        key_prefix=key[:10],
        weight=weight,
        max_pending_items=max_pending_items,
        daily_token_quota=daily_token_quota,
        tokens_per_min=tokens_per_min,
        max_files=max_files,
        max_file_bytes=max_file_bytes,
        is_admin=is_admin,
        webhook_url=check_webhook_url(webhook_url),
        webhook_secret=new_webhook_secret(),
    )
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError as exc:
        raise Conflict(f"a tenant named {name!r} already exists", field="name") from exc
    return tenant, key


# Built once (every request authenticates with it).
_BY_KEY_HASH = select(Tenant).where(Tenant.key_hash == bindparam("key_hash"))


def authenticate(session: Session, key: str | None) -> Tenant:
    """The tenant owning ``key``; :class:`Unauthorized` if missing, unknown or revoked."""
    if not key:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    tenant = session.scalar(_BY_KEY_HASH, {"key_hash": hash_key(key)})
    if tenant is None:
        raise Unauthorized("unknown API key")
    if tenant.revoked_at is not None:
        raise Unauthorized("this API key was revoked")
    return tenant


_COLUMNS = tuple(c.key for c in Tenant.__table__.columns)
_BY_KEY_HASH_SQL = f"SELECT {', '.join(_COLUMNS)} FROM tenants WHERE key_hash = %(key_hash)s"  # noqa: S608


def authenticate_detached(session: Session, key: str | None) -> Tenant:
    """:func:`authenticate`, its tenant read by one statement of the driver's and
    detached (in no session; :func:`attach` adds it to one): what every API request
    does first, at a fraction of an ORM query's cost."""
    if not key:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    rows = db.driver_rows(session, _BY_KEY_HASH_SQL, {"key_hash": hash_key(key)})
    if not rows:
        raise Unauthorized("unknown API key")
    tenant = Tenant(**{column: getattr(rows[0], column) for column in _COLUMNS})
    make_transient_to_detached(tenant)
    if tenant.revoked_at is not None:
        raise Unauthorized("this API key was revoked")
    return tenant


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
    """The tenant with this id, None if there is none or its key was revoked."""
    tenant = session.get(Tenant, tenant_id)
    return tenant if tenant is not None and tenant.revoked_at is None else None


def revoke(session: Session, name: str) -> None:
    """Revoke a tenant's key; its batches stay, new requests get 401."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}")
    tenant.revoked_at = dt.datetime.now(dt.UTC)


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.id)))


def attach(session: Session, tenant: Tenant) -> Tenant:
    """A tenant row read by another session, attached to ``session`` as it is (no
    query: the row is not read again)."""
    return session.merge(tenant, load=False)
