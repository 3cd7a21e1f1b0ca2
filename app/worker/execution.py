"""Running one delivery of an item: gate, claim, call, record exactly once.

Celery-free, so it can be driven by the task in :mod:`batchgen.tasks.generate` and by
tests alike. The path: claim (queued → running) → gate (concurrency slot, token
budget) → mark sent → provider call → record the result (or retry through the
dispatcher, or fail) → settle the budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from threading import Event
from typing import Any, TypeVar

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain import retry
from batchgen.domain.deadlines import call_timeout_s, time_left_s
from batchgen.domain.status import ItemStatus
from batchgen.errors import (
    CallCancelled,
    PermanentProviderError,
    ProviderError,
    RateLimited,
    TransientProviderError,
)
from batchgen.limits.gate import Gate, Never, Pass, Wait, running_lease_s
from batchgen.providers import get_provider
from batchgen.providers.base import ProviderRequest, ProviderResponse
from batchgen.registry import ModelSpec, Registry
from batchgen.store import db
from batchgen.store.batches import finish_if_done
from batchgen.store.db import session_scope
from batchgen.store.items import (
    Claimed,
    claim,
    defer,
    expire_if_due,
    finish_failed,
    mark_sent,
    reschedule,
    unclaim,
)
from batchgen.store.ledger import CallOutcome, record_success, record_waste
from batchgen.store.schema import Item
from batchgen.worker.cancellation import CancelWatcher

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    read_mono_s = time.monotonic()  # before the transaction whose now() the claim returns
    with session_scope() as session:
        row = session.execute(
            select(Item.model, Item.batch_id).where(Item.id == item_id)
        ).one_or_none()
        spec = registry.get(row.model) if row is not None else None
        if row is None or spec is None:
            return Verdict("skipped")
        item = claim(session, item_id, running_lease_s(spec, settings), read_mono_s)
        expired = item is None and expire_if_due(session, item_id)
    if item is None:  # duplicate, cancelled, finished, or past its deadline
        if expired:
            with session_scope() as session:
                finish_if_done(session, row.batch_id)
        return Verdict("expired" if expired else "skipped")
    try:
        decision = gate.enter(spec, item)
    except redis.RedisError:
        _give_back(item, settings)
        raise
    if not isinstance(decision, Pass):
        return _wait(item, decision, settings)
    return _run_admitted(item, spec, decision, gate, settings, watcher)


# What the gate is settled with when nothing reached the provider: the whole
# reservation is given back.
NOT_SENT = CallCancelled("not sent", billed=False)


@dataclass
class Settlement:
    """How the call ended, for :meth:`Gate.settle` (filled in as the call goes)."""

    response: ProviderResponse | None = None
    error: ProviderError | None = NOT_SENT


def _run_admitted(
    item: Claimed,
    spec: ModelSpec,
    admitted: Pass,
    gate: Gate,
    settings: Settings,
    watcher: CancelWatcher | None,
) -> Verdict:
    """From the gate's yes to its settlement: the slot and the reservation are ours
    until :func:`_settle` in ``finally``, whatever fails in between."""
    settlement = Settlement()
    try:
        with watcher.watch(item.batch_id) if watcher else nullcontext(Event()) as cancel:
            try:
                with session_scope() as session:
                    sent = mark_sent(session, item)
            except Exception as exc:
                if db.is_transient(exc):
                    _give_back(item, settings)
                raise
            if not sent:  # the batch was cancelled between the claim and now
                return Verdict("cancelled")
            return Verdict(_call(item, spec, settings, cancel, settlement))
    finally:
        _settle(gate, spec, admitted, item, settlement)


def _give_back(item: Claimed, settings: Settings) -> None:
    """Nothing was sent: back to the queue, the attempt not counted.

    Retried through a database outage for as long as the lease lasts: a
    ``mark_sent`` whose commit landed but whose reply was lost leaves ``sent_at``
    set, and if the sweep found it so it would ledger a call that was never made.
    Past the lease the sweep hands the item back (and, seeing ``sent_at``,
    ledgers the call as waste: it over-counts rather than misses).
    """
    try:
        _with_db_retries(
            item,
            "handing the item back",
            lambda session: unclaim(session, item, 0.0, settings.queued_lease_s),
        )
    except Exception as exc:
        if not db.is_transient(exc):
            raise
        log.warning("item %d: database error handing the item back; the sweep will", item.item_id)


# Retrying a transaction while the database is away: first wait, doubling up to the cap.
DB_RETRY_FIRST_S = 0.1
DB_RETRY_MAX_S = 2.0


def _with_db_retries(item: Claimed, what: str, work: Callable[[Session], T]) -> T:
    """Run ``work`` in a transaction; on a database outage (dropped connection, refused
    connect, pool time-out) retry it with backoff for as long as our lease lasts.

    Used for what follows a provider call: the call is paid, so its outcome must
    not be dropped while the item is still ours. Past the lease the error is
    raised (the sweep then ledgers the call as waste and hands the item back).
    """
    delay_s = DB_RETRY_FIRST_S
    while True:
        try:
            with session_scope() as session:
                return work(session)
        except Exception as exc:
            left_s = item.lease_left_s()
            if not db.is_transient(exc) or left_s <= 0:
                raise
            log.warning(
                "item %d: database error %s (%s), retrying; lease left %.1f s",
                item.item_id,
                what,
                type(exc).__name__,
                left_s,
            )
            time.sleep(min(delay_s, left_s))
            delay_s = min(2 * delay_s, DB_RETRY_MAX_S)


def _finish_batch(item: Claimed) -> None:
    """Close the batch if this was its last item (best effort: the sweep also does it)."""
    try:
        with session_scope() as session:
            finish_if_done(session, item.batch_id)
    except Exception as exc:
        if not db.is_transient(exc):
            raise
        log.warning("item %d: database error closing its batch; the sweep will", item.item_id)


def _cancelled(item: Claimed, spec: ModelSpec, exc: CallCancelled) -> str:
    """The batch was cancelled mid-call: the item ends cancelled; a billed call is waste."""

    def work(session: Session) -> None:
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

    _with_db_retries(item, "recording the cancellation", work)
    _finish_batch(item)
    return "cancelled"


def _settle(
    gate: Gate, spec: ModelSpec, admitted: Pass, item: Claimed, settlement: Settlement
) -> None:
    """Budget bookkeeping after a call; a Redis error must not undo the call's outcome."""
    outcome: dict[str, Any] = (
        {"response": settlement.response}
        if settlement.response is not None
        else {"error": settlement.error}
    )
    try:
        gate.settle(spec, admitted, item.tenant_id, item.max_tokens, **outcome)
    except redis.RedisError:
        log.warning(
            "item %d: Redis error settling the budget; the reservation ages out", item.item_id
        )


def _call(
    item: Claimed,
    spec: ModelSpec,
    settings: Settings,
    cancel: Event,
    settlement: Settlement,
) -> str:
    # Time left on PostgreSQL's clock (where the deadline was set), not this host's.
    timeout = call_timeout_s(
        spec.call_timeout_s or settings.call_timeout_s, item.deadline_at, item.db_now()
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
    # From here the provider may see the request: unless told otherwise, the
    # reservation is kept (the provider may have counted it).
    settlement.error = MAYBE_SENT
    try:
        response = get_provider(spec).complete(request)
    except ProviderError as exc:
        settlement.error = exc
        return _failed(item, spec, settings, exc, started)
    settlement.response, settlement.error = response, None
    latency_s = time.monotonic() - started
    # A paid answer is recorded before anything else; a database outage is waited
    # out for as long as the lease lasts.
    recorded = _with_db_retries(
        item,
        "recording the result",
        lambda session: record_success(session, _outcome(item, response, latency_s), spec),
    )
    _finish_batch(item)
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


MAYBE_SENT = TransientProviderError("the call did not end normally", billed=True)


def _failed(
    item: Claimed, spec: ModelSpec, settings: Settings, exc: ProviderError, started: float
) -> str:
    if isinstance(exc, CallCancelled):
        return _cancelled(item, spec, exc)

    def work(session: Session) -> str:
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
        return handle_failure(session, item, exc, spec, settings)

    verdict = _with_db_retries(item, "recording the failure", work)
    if verdict != "retry":
        _finish_batch(item)
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
