"""Running one delivery of an item: gate, claim, call, record exactly once.

Celery-free, so it can be driven by the task in :mod:`tasks.generate` and by
tests alike. The path: claim (queued → running) → gate (concurrency slot, token
budget) → mark sent → provider call → record the result (or retry through the
dispatcher, or fail) → settle the budget.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from threading import Event
from typing import Any

import redis
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from app import retry
from app.accounting import CallOutcome, record_success, record_waste
from app.batches import finish_if_done
from app.cancellation import CancelWatcher
from app.config import Settings
from app.db import session_scope
from app.deadlines import call_timeout_s, time_left_s
from app.errors import CallCancelled, PermanentProviderError, ProviderError, RateLimited
from app.gate import Gate, Never, Pass, Wait, running_lease_s
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
    """The gate said no: hand the item back (short wait, long wait) or end it.

    Only a firm wait past the deadline expires the item (:func:`retry.plan_wait`);
    a tenant-budget wait goes back to pending so it holds no dispatch capacity.
    """
    with session_scope() as session:
        if isinstance(decision, Never):
            finish_failed(session, item, "too_large", decision.reason)
            verdict = Verdict("failed")
        else:
            plan = retry.plan_wait(
                decision.wait_s,
                time_left_s(item.deadline_at, item.now),
                firm=decision.kind.firm,
                releases_dispatch=decision.kind.releases_dispatch,
                max_countdown_s=settings.max_countdown_s,
            )
            if plan.action is retry.WaitAction.DEFER:
                defer(session, item, plan.wait_s, decision.reason)
                return Verdict("deferred")
            if plan.action is retry.WaitAction.REQUEUE:
                unclaim(session, item, plan.wait_s, settings.queued_lease_s)
                return Verdict("wait", plan.wait_s)
            finish_failed(
                session,
                item,
                "expired",
                f"{decision.reason}: the wait would pass the deadline",
                ItemStatus.EXPIRED,
            )
            verdict = Verdict("expired")
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
        row = session.execute(
            select(Item.model, Item.batch_id).where(Item.id == item_id)
        ).one_or_none()
        spec = registry.get(row.model) if row is not None else None
        if row is None or spec is None:
            return Verdict("skipped")
        item = claim(session, item_id, running_lease_s(spec, settings))
        expired = item is None and expire_if_due(session, item_id)
    if item is None:  # duplicate, cancelled, finished, or past its deadline
        if expired:
            with session_scope() as session:
                finish_if_done(session, row.batch_id)
        return Verdict("expired" if expired else "skipped")
    try:
        decision = gate.enter(spec, item)
    except redis.RedisError:
        with session_scope() as session:  # give the attempt back; the sweep re-releases it
            unclaim(session, item, 0.0, settings.queued_lease_s)
        raise
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


RECORD_TRIES = 5


def _record(item: Claimed, response: ProviderResponse, latency_s: float, spec: ModelSpec) -> bool:
    for attempt in range(1, RECORD_TRIES + 1):
        try:
            with session_scope() as session:
                return record_success(session, _outcome(item, response, latency_s), spec)
        except OperationalError:
            if attempt == RECORD_TRIES:
                raise
            log.warning("item %d: database error recording the result, retrying", item.item_id)
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")


def _settle(gate: Gate, spec: ModelSpec, admitted: Pass, item: Claimed, **outcome: Any) -> None:
    """Budget bookkeeping after a call; a Redis error must not undo the call's outcome."""
    try:
        gate.settle(spec, admitted, item.tenant_id, item.max_tokens, **outcome)
    except redis.RedisError:
        log.warning(
            "item %d: Redis error settling the budget; the reservation ages out", item.item_id
        )


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
        _settle(gate, spec, admitted, item, error=exc)
        if isinstance(exc, CallCancelled):
            return _cancelled(item, spec, exc)
        with session_scope() as session:
            if exc.billed:
                # The provider may charge a call that failed after it was sent; its usage
                # is unknown, so the ledger carries the prompt estimate, marked as waste.
                record_waste(
                    session,
                    CallOutcome(
                        item.item_id,
                        item.attempt,
                        item.prompt_tokens_est,
                        0,
                        {},
                        None,
                        int((time.monotonic() - started) * 1000),
                        0,
                    ),
                    spec,
                    f"failed_{exc.kind}",
                )
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
    # A paid answer is recorded before anything else can fail (the budget lives in
    # Redis, which may be restarting); a dropped database connection is retried.
    recorded = _record(item, response, latency_s, spec)
    _settle(gate, spec, admitted, item, response=response)
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
