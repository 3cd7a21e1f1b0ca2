"""The exactly-once recording of results and usage: results, the ledger, daily totals.

One ledger row per (item, attempt) that may have been billed (``UNIQUE (item_id,
attempt)``, ``ON CONFLICT DO NOTHING``), written after locking the item row, in
the same transaction as the result and the daily totals. The item's own state
moves go through :mod:`batchgen.store.items`.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import Date, cast, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from batchgen.domain.cost import cost_usd
from batchgen.domain.status import TERMINAL, ItemStatus
from batchgen.registry import ModelSpec, Registry
from batchgen.store import items
from batchgen.store.items import LockedItem
from batchgen.store.schema import Result, TenantDailyUsage, UsageLedger


@dataclass(frozen=True, kw_only=True)
class CallOutcome:
    """A billed provider call of one attempt of one item (an answer, or an estimate)."""

    item_id: int
    attempt: int
    prompt_tokens: int
    completion_tokens: int = 0
    response: dict[str, Any] = field(default_factory=dict)
    provider_request_id: str | None = None
    upstream_latency_ms: int = 0
    queue_wait_ms: int = 0


# Waste rows written without the provider's answer, because the worker that sent
# the call was lost (its lease ran out) or another attempt finished the item while
# this one was in flight. Their usage is the prompt estimate; if the answer still
# comes, it replaces the estimate in place (never a second row for one call).
LOST_CALL = "worker_lost"
SUPERSEDED_CALL = "superseded_in_flight"
ESTIMATED = frozenset({LOST_CALL, SUPERSEDED_CALL})


def _add_daily(
    session: Session,
    item: LockedItem,
    day: dt.date,
    requests: int,
    prompt_tokens: int,
    completion_tokens: int,
    cost: Decimal,
) -> None:
    """Add to the tenant's daily totals (deltas may be negative when an estimate is replaced)."""
    stmt = pg_insert(TenantDailyUsage).values(
        tenant_id=item.tenant_id,
        day=day,
        model=item.model,
        requests=requests,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cost_usd=cost,
    )
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=["tenant_id", "day", "model"],
            set_={
                "requests": TenantDailyUsage.requests + stmt.excluded.requests,
                "prompt_tokens": TenantDailyUsage.prompt_tokens + stmt.excluded.prompt_tokens,
                "completion_tokens": TenantDailyUsage.completion_tokens
                + stmt.excluded.completion_tokens,
                "cost_usd": TenantDailyUsage.cost_usd + stmt.excluded.cost_usd,
            },
        )
    )


def _ledger(
    session: Session, item: LockedItem, outcome: CallOutcome, cost: Decimal, waste: str | None
) -> bool:
    """Insert the ledger row for (item, attempt) once; daily totals follow it."""
    inserted = session.execute(
        pg_insert(UsageLedger)
        .values(
            item_id=item.id,
            attempt=outcome.attempt,
            tenant_id=item.tenant_id,
            batch_id=item.batch_id,
            model=item.model,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            cost_usd=cost,
            waste_reason=waste,
        )
        .on_conflict_do_nothing(index_elements=["item_id", "attempt"])
        .returning(UsageLedger.id)
    ).scalar_one_or_none()
    if inserted is None:
        return False
    # Days are UTC days, whatever the database server's time zone.
    day = session.scalar(select(cast(func.timezone("UTC", func.now()), Date)))
    assert day is not None
    _add_daily(session, item, day, 1, outcome.prompt_tokens, outcome.completion_tokens, cost)
    return True


def _replace_estimate(
    session: Session, item: LockedItem, outcome: CallOutcome, cost: Decimal, waste: str | None
) -> bool:
    """The answer of a call ledgered as an estimate arrived after all: its row takes the
    real usage (and becomes the result's row when ``waste`` is None), the daily totals
    of the row's day follow. False when (item, attempt) has no estimated row."""
    row = session.scalars(
        select(UsageLedger)
        .where(UsageLedger.item_id == item.id, UsageLedger.attempt == outcome.attempt)
        .with_for_update()
    ).one_or_none()
    if row is None or row.waste_reason not in ESTIMATED:
        return False
    day = session.scalar(select(cast(func.timezone("UTC", row.created_at), Date)))
    assert day is not None
    _add_daily(
        session,
        item,
        day,
        0,
        outcome.prompt_tokens - row.prompt_tokens,
        outcome.completion_tokens - row.completion_tokens,
        cost - row.cost_usd,
    )
    row.prompt_tokens = outcome.prompt_tokens
    row.completion_tokens = outcome.completion_tokens
    row.cost_usd = cost
    row.waste_reason = waste
    return True


def _estimate(
    item: LockedItem, attempt: int, spec: ModelSpec | None
) -> tuple[CallOutcome, Decimal]:
    """A sent call whose answer we do not have: the prompt estimate, no completion."""
    outcome = CallOutcome(item_id=item.id, attempt=attempt, prompt_tokens=item.prompt_tokens_est)
    cost = cost_usd(item.prompt_tokens_est, 0, spec) if spec is not None else Decimal(0)
    return outcome, cost


def record_lost_call(session: Session, item_id: int, attempt: int, registry: Registry) -> bool:
    """Ledger as waste a sent call whose worker was lost (once per (item, attempt))."""
    item = items.lock(session, item_id, for_update=False)
    assert item is not None
    outcome, cost = _estimate(item, attempt, registry.get(item.model))
    return _ledger(session, item, outcome, cost, LOST_CALL)


def _supersede(session: Session, item: LockedItem, attempt: int, spec: ModelSpec) -> None:
    """``attempt`` finishes the item while a newer attempt's call is in flight: that call
    may be billed too, and its worker may never report it; ledger it now as waste."""
    newer_sent = (
        item.status is ItemStatus.RUNNING and item.attempts != attempt and item.sent_at is not None
    )
    if newer_sent:
        outcome, cost = _estimate(item, item.attempts, spec)
        _ledger(session, item, outcome, cost, SUPERSEDED_CALL)


def record_success(session: Session, outcome: CallOutcome, spec: ModelSpec) -> bool:
    """Record a successful call exactly once, in the caller's transaction.

    The item row is locked first, so a duplicate run of the same item waits
    and then sees the first one's verdict. Returns True when this call's
    result became the item's result; False when the call was wasted (the item
    already finished, or it was re-leased to another attempt), in which case
    it is still written to the ledger, marked as waste.
    """
    item = items.lock(session, outcome.item_id)
    assert item is not None
    cost = cost_usd(outcome.prompt_tokens, outcome.completion_tokens, spec)
    if item.status in TERMINAL:
        waste = f"item_already_{item.status.value}"
        if not _ledger(session, item, outcome, cost, waste):
            _replace_estimate(session, item, outcome, cost, waste)
        return False
    # Not terminal: even if our lease ran out and the item went back to the
    # queue, the answer is good; it becomes the result and the newer attempt
    # will find the item finished when it claims it. If the sweep ledgered this
    # call as lost meanwhile, that row becomes the result's row.
    recorded = _ledger(session, item, outcome, cost, None) or _replace_estimate(
        session, item, outcome, cost, None
    )
    if not recorded:
        return False  # this very attempt was already recorded
    _supersede(session, item, outcome.attempt, spec)
    session.execute(
        pg_insert(Result)
        .values(
            item_id=item.id,
            batch_id=item.batch_id,
            tenant_id=item.tenant_id,
            attempt=outcome.attempt,
            response=outcome.response,
            provider_request_id=outcome.provider_request_id,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            cost_usd=cost,
            upstream_latency_ms=outcome.upstream_latency_ms,
            queue_wait_ms=outcome.queue_wait_ms,
        )
        .on_conflict_do_nothing(index_elements=["item_id"])
    )
    items.succeed(session, item.id)
    return True


def record_waste(session: Session, outcome: CallOutcome, spec: ModelSpec, reason: str) -> None:
    """Ledger a billed call that produced no result (cancelled mid-call, malformed...)."""
    item = items.lock(session, outcome.item_id, for_update=False)
    assert item is not None
    cost = cost_usd(outcome.prompt_tokens, outcome.completion_tokens, spec)
    _ledger(session, item, outcome, cost, reason)
