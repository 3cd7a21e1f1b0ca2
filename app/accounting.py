"""Cost (pure) and the exactly-once recording of results and usage."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import Date, cast, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from app.registry import ModelSpec
from app.schema import Item, Result, TenantDailyUsage, UsageLedger
from app.status import TERMINAL, ItemStatus

MILLION = Decimal(1_000_000)


def cost_usd(prompt_tokens: int, completion_tokens: int, spec: ModelSpec) -> Decimal:
    """Price of one call from the registry's per-1M-token prices, exact in Decimal."""
    return (
        Decimal(prompt_tokens) * Decimal(str(spec.input_usd_per_1m))
        + Decimal(completion_tokens) * Decimal(str(spec.output_usd_per_1m))
    ) / MILLION


@dataclass(frozen=True)
class CallOutcome:
    """A billed provider answer for one attempt of one item."""

    item_id: int
    attempt: int
    prompt_tokens: int
    completion_tokens: int
    response: dict[str, Any]
    provider_request_id: str | None
    upstream_latency_ms: int
    queue_wait_ms: int


def _ledger(
    session: Session, item: Item, outcome: CallOutcome, cost: Decimal, waste: str | None
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
    stmt = pg_insert(TenantDailyUsage).values(
        tenant_id=item.tenant_id,
        day=day,
        model=item.model,
        requests=1,
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
        cost_usd=cost,
    )
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=["tenant_id", "day", "model"],
            set_={
                "requests": TenantDailyUsage.requests + 1,
                "prompt_tokens": TenantDailyUsage.prompt_tokens + stmt.excluded.prompt_tokens,
                "completion_tokens": TenantDailyUsage.completion_tokens
                + stmt.excluded.completion_tokens,
                "cost_usd": TenantDailyUsage.cost_usd + stmt.excluded.cost_usd,
            },
        )
    )
    return True


def record_success(session: Session, outcome: CallOutcome, spec: ModelSpec) -> bool:
    """Record a successful call exactly once, in the caller's transaction.

    The item row is locked first, so a duplicate run of the same item waits
    and then sees the first one's verdict. Returns True when this call's
    result became the item's result; False when the call was wasted (the item
    already finished, or it was re-leased to another attempt), in which case
    it is still written to the ledger, marked as waste.
    """
    item = session.get(Item, outcome.item_id, with_for_update=True)
    assert item is not None
    cost = cost_usd(outcome.prompt_tokens, outcome.completion_tokens, spec)
    if item.status in TERMINAL:
        _ledger(session, item, outcome, cost, f"item_already_{item.status}")
        return False
    # Not terminal: even if our lease ran out and the item went back to the
    # queue, the answer is good; it becomes the result and the newer attempt
    # will find the item finished when it claims it.
    if not _ledger(session, item, outcome, cost, None):
        return False  # this very attempt was already recorded
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
    item.status = ItemStatus.SUCCEEDED.value
    item.finished_at = session.scalar(select(func.now()))
    item.lease_expires_at = None
    item.error_code = None
    item.last_error = None
    return True


def record_waste(session: Session, outcome: CallOutcome, spec: ModelSpec, reason: str) -> None:
    """Ledger a billed call that produced no result (cancelled mid-call, malformed...)."""
    item = session.get(Item, outcome.item_id)
    assert item is not None
    cost = cost_usd(outcome.prompt_tokens, outcome.completion_tokens, spec)
    _ledger(session, item, outcome, cost, reason)
