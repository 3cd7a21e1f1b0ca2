"""The Python API for trusted server-side code (a Django view, a Flask route, a job).

Each function opens its own transaction and names the tenant by name; the
HTTP API authenticates an API key and then calls the same functions with the
tenant it found. All raise the project's typed exceptions (:mod:`app.errors`).

    from app.client import submit_batch, get_batch, iter_results, cancel_batch

    batch = submit_batch(requests, tenant="acme", completion_window="2h")
    get_batch(batch["id"], tenant="acme")["request_counts"]
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from app import batches, counters
from app.batches import SubmitOptions
from app.cancellation import announce
from app.config import get_settings
from app.db import session_scope
from app.errors import ClientError, NotFound, Overloaded
from app.redis_client import get_redis
from app.registry import get_registry
from app.schema import Tenant
from app.status import Priority

log = logging.getLogger(__name__)
CANCEL_TRIES = 3

RequestLines = Iterable[bytes] | Iterable[Mapping[str, Any]] | str | Path


def _tenant(session: Session, tenant: str | Tenant) -> Tenant:
    if isinstance(tenant, Tenant):
        found = session.get(Tenant, tenant.id)
    else:
        found = session.scalar(select(Tenant).where(Tenant.name == tenant))
    if found is None:
        raise NotFound(f"no tenant named {tenant!r}")
    return found


def as_lines(requests: RequestLines) -> Iterator[bytes]:
    """JSONL byte lines from a path, bytes lines, or request dicts."""
    if isinstance(requests, str | Path):
        with open(requests, "rb") as fh:
            yield from fh
        return
    for entry in requests:
        if isinstance(entry, bytes | bytearray):
            yield bytes(entry)
        else:
            yield json.dumps(entry, ensure_ascii=False).encode("utf-8") + b"\n"


def submit_in_session(
    session: Session, tenant: Tenant, lines: Iterable[bytes], options: SubmitOptions
) -> tuple[dict[str, Any], bool]:
    """Store a batch in ``session``'s transaction; returns its description and ``created``.

    A refusal is counted per tenant and reason (metrics) before it propagates.
    """
    try:
        batch, created = batches.store_batch(
            session, tenant, lines, options, get_registry(), get_settings()
        )
    except (ClientError, Overloaded) as exc:
        counters.record_rejection(get_redis(), tenant.name, exc.code)
        raise
    return batches.describe(session, batch), created


def wake_dispatcher() -> None:
    """Tell a dispatcher new work is waiting (a Celery message; beat covers a lost one)."""
    from tasks.dispatch import wake

    try:
        wake()
    except Exception:  # the batch is stored; the beat tick dispatches it anyway
        log.warning("could not wake the dispatcher; the next beat tick will release the batch")


def submit_batch(
    requests: RequestLines,
    *,
    tenant: str | Tenant,
    completion_window: str | float = "24h",
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    priority: Priority | str = Priority.INTERACTIVE,
) -> dict[str, Any]:
    """Validate and store a batch (all or nothing), then wake the dispatcher.

    ``requests`` is a JSONL file path, an iterable of JSONL byte lines, or an
    iterable of dicts in the OpenAI Batch input format
    (``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}``).
    With an ``idempotency_key`` already used by this tenant, the existing
    batch is returned and nothing new is stored.
    """
    options = SubmitOptions(completion_window, metadata, idempotency_key, Priority(priority))
    with session_scope() as session:
        described, created = submit_in_session(
            session, _tenant(session, tenant), as_lines(requests), options
        )
    if created:
        wake_dispatcher()
    return described


def get_batch(batch_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
    """Status and ``request_counts`` of one of the tenant's batches."""
    with session_scope() as session:
        batch = batches.get_owned_batch(session, _tenant(session, tenant), batch_id)
        return batches.describe(session, batch)


def list_batches(
    *, tenant: str | Tenant, limit: int = 20, after: str | None = None
) -> list[dict[str, Any]]:
    """The tenant's batches, newest first."""
    with session_scope() as session:
        owner = _tenant(session, tenant)
        return [
            batches.describe(session, b)
            for b in batches.list_batches(session, owner, limit=limit, after=after)
        ]


def iter_results(batch_id: str, *, tenant: str | Tenant) -> Iterator[dict[str, Any]]:
    """Finished items of a batch in input order, OpenAI Batch output format."""
    with session_scope() as session:
        batch = batches.get_owned_batch(session, _tenant(session, tenant), batch_id)
        yield from batches.iter_results(session, batch)


def cancel_batch(batch_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
    """Cancel: items not yet running end now; running calls are stopped."""
    for attempt in range(1, CANCEL_TRIES + 1):
        try:
            with session_scope() as session:
                batch = batches.cancel(session, _tenant(session, tenant), batch_id)
                described = batches.describe(session, batch)
            break
        except OperationalError:  # a deadlock with a concurrent sweep: PostgreSQL chose us
            if attempt == CANCEL_TRIES:
                raise
    announce(get_redis(), batch_id)
    return described


def usage(
    *,
    tenant: str | Tenant | None,
    start: str | None = None,
    end: str | None = None,
    group_by: str = "model",
) -> list[dict[str, Any]]:
    """Requests, tokens, cost and waste per model, day (or tenant, for ``tenant=None``:
    the admin view over all tenants) between ``start`` and ``end`` (ISO dates)."""
    import datetime as dt

    from app import usage as usage_report

    first, last = usage_report.parse_range(start, end, dt.datetime.now(dt.UTC).date())
    with session_scope() as session:
        tenant_id = None if tenant is None else _tenant(session, tenant).id
        return usage_report.report(session, first, last, group_by, tenant_id)
