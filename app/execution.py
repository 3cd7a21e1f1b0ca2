"""Running one item: claim, call the provider, record the outcome exactly once.

Celery-free, so it can be driven by the task in :mod:`tasks.generate` and by
tests alike. Every state change is a conditional UPDATE on the item row: a
duplicate delivery, a cancelled or a finished item simply finds nothing to do.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app import retry
from app.accounting import CallOutcome, record_success
from app.batches import finish_if_done
from app.config import Settings
from app.db import session_scope
from app.deadlines import call_timeout_s, time_left_s
from app.errors import PermanentProviderError, ProviderError, RateLimited
from app.providers import get_provider
from app.providers.base import ProviderRequest, ProviderResponse
from app.registry import ModelSpec, Registry
from app.schema import Item
from app.status import ItemStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claimed:
    """What a worker needs of an item it now runs (``attempt`` counts from 1)."""

    item_id: int
    batch_id: str
    tenant_id: int
    model: str
    body: dict[str, Any]
    attempt: int
    deadline_at: dt.datetime
    created_at: dt.datetime
    started_at: dt.datetime
    prompt_tokens_est: int
    max_tokens: int


def claim(session: Session, item_id: int, lease_s: float) -> Claimed | None:
    """``queued → running`` with a lease; None when the item is not ours to run."""
    now = func.now()
    row = session.execute(
        update(Item)
        .where(Item.id == item_id, Item.status == ItemStatus.QUEUED.value, Item.deadline_at > now)
        .values(
            status=ItemStatus.RUNNING.value,
            attempts=Item.attempts + 1,
            started_at=now,
            lease_expires_at=now + dt.timedelta(seconds=lease_s),
        )
        .returning(
            Item.id,
            Item.batch_id,
            Item.tenant_id,
            Item.model,
            Item.body,
            Item.attempts,
            Item.deadline_at,
            Item.created_at,
            Item.started_at,
            Item.prompt_tokens_est,
            Item.max_tokens,
        )
    ).one_or_none()
    return Claimed(*row) if row is not None else None


def expire_if_due(session: Session, item_id: int) -> bool:
    """A queued item whose deadline passed becomes expired without any call."""
    result = session.execute(
        update(Item)
        .where(
            Item.id == item_id,
            Item.status.in_([ItemStatus.QUEUED.value, ItemStatus.PENDING.value]),
            Item.deadline_at <= func.now(),
        )
        .values(
            status=ItemStatus.EXPIRED.value,
            finished_at=func.now(),
            lease_expires_at=None,
            error_code="expired",
            last_error="deadline passed before the item could run",
        )
        .returning(Item.id)
    )
    return result.scalar_one_or_none() is not None


def _owned(item: Claimed) -> Any:
    """WHERE clause: the item is still running under this very attempt."""
    return (
        (Item.id == item.item_id)
        & (Item.status == ItemStatus.RUNNING.value)
        & (Item.attempts == item.attempt)
    )


def finish_failed(
    session: Session, item: Claimed, code: str, message: str, status: ItemStatus = ItemStatus.FAILED
) -> bool:
    result = session.execute(
        update(Item)
        .where(_owned(item))
        .values(
            status=status.value,
            finished_at=func.now(),
            lease_expires_at=None,
            error_code=code,
            last_error=message,
        )
        .returning(Item.id)
    )
    return result.scalar_one_or_none() is not None


def reschedule(session: Session, item: Claimed, wait_s: float, code: str, message: str) -> bool:
    """Back to pending, not before ``now + wait_s``: the retry goes through the dispatcher."""
    result = session.execute(
        update(Item)
        .where(_owned(item))
        .values(
            status=ItemStatus.PENDING.value,
            not_before=func.now() + dt.timedelta(seconds=wait_s),
            lease_expires_at=None,
            error_code=code,
            last_error=message,
        )
        .returning(Item.id)
    )
    return result.scalar_one_or_none() is not None


def handle_failure(
    session: Session, item: Claimed, exc: ProviderError, spec: ModelSpec, settings: Settings
) -> str:
    """Retry a transient failure inside the deadline and the attempt cap, else fail it."""
    now = session.scalar(select(func.now()))
    assert now is not None
    max_attempts = min(spec.max_attempts, settings.max_attempts)
    message = f"{exc.kind}: {exc.message}"
    if isinstance(exc, PermanentProviderError):
        finish_failed(session, item, exc.kind, message)
        return "failed"
    if item.attempt >= max_attempts:
        finish_failed(session, item, exc.kind, f"{message} (after {item.attempt} attempts)")
        return "failed"
    wait = retry.backoff_s(
        item.attempt,
        retry_after_s=exc.retry_after_s if isinstance(exc, RateLimited) else None,
        initial_s=settings.retry_base_s,
        max_s=settings.retry_max_s,
    )
    if not retry.fits_deadline(wait, time_left_s(item.deadline_at, now)):
        finish_failed(
            session, item, "expired", f"{message}; no time left to retry", ItemStatus.EXPIRED
        )
        return "expired"
    reschedule(session, item, wait, exc.kind, message)
    return "retry"


def _outcome(item: Claimed, response: ProviderResponse, latency_s: float) -> CallOutcome:
    return CallOutcome(
        item_id=item.item_id,
        attempt=item.attempt,
        prompt_tokens=response.prompt_tokens,
        completion_tokens=response.completion_tokens,
        response=response.body,
        provider_request_id=response.request_id,
        upstream_latency_ms=int(latency_s * 1000),
        queue_wait_ms=max(0, int((item.started_at - item.created_at).total_seconds() * 1000)),
    )


def run_item(item_id: int, registry: Registry, settings: Settings) -> str:
    """Run one item end to end; returns what happened (for logs and tests)."""
    with session_scope() as session:
        lease_s = settings.call_timeout_s + settings.running_lease_margin_s
        item = claim(session, item_id, lease_s)
        if item is None:
            return "expired" if expire_if_due(session, item_id) else "skipped"
    spec = registry[item.model]
    timeout = call_timeout_s(
        spec.call_timeout_s or settings.call_timeout_s, item.deadline_at, dt.datetime.now(dt.UTC)
    )
    request = ProviderRequest(spec=spec, body=item.body, timeout_s=timeout, item_id=item_id)
    started = time.monotonic()
    try:
        response = get_provider(spec).complete(request)
    except ProviderError as exc:
        with session_scope() as session:
            verdict = handle_failure(session, item, exc, spec, settings)
        if verdict != "retry":
            with session_scope() as session:
                finish_if_done(session, item.batch_id)
        log.warning(
            "item %d attempt %d model %s %s: %s status=%s",
            item_id,
            item.attempt,
            spec.name,
            verdict,
            exc.kind,
            exc.status,
        )
        return verdict
    latency_s = time.monotonic() - started
    with session_scope() as session:
        recorded = record_success(session, _outcome(item, response, latency_s), spec)
    with session_scope() as session:
        finish_if_done(session, item.batch_id)
    log.info(
        "item %d attempt %d model %s succeeded prompt_tokens=%d completion_tokens=%d "
        "latency_ms=%d recorded=%s",
        item_id,
        item.attempt,
        spec.name,
        response.prompt_tokens,
        response.completion_tokens,
        latency_s * 1000,
        recorded,
    )
    return "succeeded" if recorded else "duplicate"
