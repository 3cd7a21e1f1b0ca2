"""Running one delivery of an item: gate, claim, call, record exactly once.

Celery-free, so it can be driven by the task in :mod:`tasks.generate` and by
tests alike. The path: peek (is it still queued?) → gate (concurrency slot,
token budget) → claim (queued → running) → provider call → settle the budget →
record the result, or retry through the dispatcher, or fail.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from threading import Event

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app import retry
from app.accounting import CallOutcome, record_success, record_waste
from app.batches import finish_if_done
from app.cancellation import CancelWatcher
from app.config import Settings
from app.db import session_scope
from app.deadlines import call_timeout_s, time_left_s
from app.errors import CallCancelled, PermanentProviderError, ProviderError, RateLimited
from app.gate import Gate, Never, Pass, Wait
from app.items import (
    Claimed,
    claim,
    defer,
    expire_if_due,
    finish_failed,
    mark_sent,
    reschedule,
    unclaim,
)
from app.providers import get_provider
from app.providers.base import ProviderRequest, ProviderResponse
from app.registry import ModelSpec, Registry
from app.schema import Item
from app.status import ItemStatus

log = logging.getLogger(__name__)


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
    if not reschedule(session, item, wait, exc.kind, message):
        finish_failed(session, item, "cancelled", "batch cancelled", ItemStatus.CANCELLED)
        return "cancelled"
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


@dataclass(frozen=True)
class Verdict:
    """What happened to one delivery. ``countdown_s`` is set for a budget wait:
    the task retries itself after that long without using up an attempt."""

    outcome: str
    countdown_s: float | None = None


def _wait(item: Claimed, decision: Wait | Never, settings: Settings) -> Verdict:
    """The gate said no: hand the item back (short wait, long wait) or end it."""
    with session_scope() as session:
        if isinstance(decision, Never):
            finish_failed(session, item, "too_large", decision.reason)
            verdict = Verdict("failed")
        elif not retry.fits_deadline(decision.wait_s, time_left_s(item.deadline_at, item.now)):
            finish_failed(
                session,
                item,
                "expired",
                f"{decision.reason}: the wait would pass the deadline",
                ItemStatus.EXPIRED,
            )
            verdict = Verdict("expired")
        elif decision.wait_s > settings.max_countdown_s:
            defer(session, item, decision.wait_s, decision.reason)
            return Verdict("deferred")
        else:
            unclaim(session, item, decision.wait_s, settings.queued_lease_s)
            return Verdict("wait", decision.wait_s)
    with session_scope() as session:
        finish_if_done(session, item.batch_id)
    return verdict


def run_item(
    item_id: int,
    registry: Registry,
    settings: Settings,
    gate: Gate,
    watcher: CancelWatcher | None = None,
) -> Verdict:
    """Run one delivery of an item end to end."""
    with session_scope() as session:
        model = session.scalar(select(Item.model).where(Item.id == item_id))
        spec = registry.get(model or "")
        if spec is None:
            return Verdict("skipped")
        lease_s = (spec.call_timeout_s or settings.call_timeout_s) + settings.running_lease_margin_s
        item = claim(session, item_id, lease_s)
        if item is None:  # duplicate, cancelled, finished, or past its deadline
            return Verdict("expired" if expire_if_due(session, item_id) else "skipped")
    decision = gate.enter(spec, item)
    if not isinstance(decision, Pass):
        return _wait(item, decision, settings)
    with watcher.watch(item.batch_id) if watcher else nullcontext(Event()) as cancel:
        with session_scope() as session:
            sent = mark_sent(session, item)
        if not sent:  # the batch was cancelled between the claim and now
            gate.settle(
                spec,
                decision,
                item.tenant_id,
                item.max_tokens,
                error=CallCancelled("cancelled before sending", billed=False),
            )
            return Verdict("cancelled")
        return Verdict(_call(item, spec, decision, gate, settings, cancel))


def _cancelled(item: Claimed, spec: ModelSpec, exc: CallCancelled) -> str:
    """The batch was cancelled mid-call: the item ends cancelled; a billed call is waste."""
    with session_scope() as session:
        finish_failed(
            session, item, "cancelled", "batch cancelled during the call", ItemStatus.CANCELLED
        )
        if exc.billed:
            record_waste(
                session,
                CallOutcome(
                    item.item_id,
                    item.attempt,
                    exc.prompt_tokens or item.prompt_tokens_est,
                    exc.completion_tokens or 0,
                    {},
                    None,
                    0,
                    0,
                ),
                spec,
                "cancelled_mid_call",
            )
    with session_scope() as session:
        finish_if_done(session, item.batch_id)
    return "cancelled"


def _call(
    item: Claimed,
    spec: ModelSpec,
    admitted: Pass,
    gate: Gate,
    settings: Settings,
    cancel: Event,
) -> str:
    timeout = call_timeout_s(
        spec.call_timeout_s or settings.call_timeout_s, item.deadline_at, dt.datetime.now(dt.UTC)
    )
    request = ProviderRequest(
        spec=spec,
        body=item.body,
        timeout_s=timeout,
        item_id=item.item_id,
        cancel=cancel,
        stream=settings.stream_calls,
    )
    started = time.monotonic()
    try:
        response = get_provider(spec).complete(request)
    except ProviderError as exc:
        gate.settle(spec, admitted, item.tenant_id, item.max_tokens, error=exc)
        if isinstance(exc, CallCancelled):
            return _cancelled(item, spec, exc)
        with session_scope() as session:
            verdict = handle_failure(session, item, exc, spec, settings)
        if verdict != "retry":
            with session_scope() as session:
                finish_if_done(session, item.batch_id)
        log.warning(
            "item %d attempt %d model %s %s: %s status=%s",
            item.item_id,
            item.attempt,
            spec.name,
            verdict,
            exc.kind,
            exc.status,
        )
        return verdict
    latency_s = time.monotonic() - started
    gate.settle(spec, admitted, item.tenant_id, item.max_tokens, response=response)
    with session_scope() as session:
        recorded = record_success(session, _outcome(item, response, latency_s), spec)
    with session_scope() as session:
        finish_if_done(session, item.batch_id)
    log.info(
        "item %d attempt %d model %s succeeded prompt_tokens=%d completion_tokens=%d "
        "latency_ms=%d recorded=%s",
        item.item_id,
        item.attempt,
        spec.name,
        response.prompt_tokens,
        response.completion_tokens,
        latency_s * 1000,
        recorded,
    )
    return "succeeded" if recorded else "duplicate"
