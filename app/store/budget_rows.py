"""Dollar budgets in PostgreSQL: the budgets themselves, and what the ledger says
was spent and what is in flight in a budget's period (batchgen.domain.billing.budget_maths).

A budget belongs to a tenant (``key_id`` None: all its calls) or to one of its keys
(the calls and batches made with that key, ``batches.key_id``). Redis holds the
reservations (:mod:`batchgen.limits.money_budgets`); what is here is the truth it is rebuilt
from.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from batchgen.domain.billing.budget_maths import BudgetRule, Period, to_micros
from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.store.schema import ApiKey, Batch, Item, MoneyBudget, Tenant, UsageLedger


@dataclass(frozen=True)
class StoredBudget:
    id: int
    tenant_id: int
    key_id: int | None
    rule: BudgetRule

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "tenant_id": self.tenant_id,
            "key_id": self.key_id,
            "limit_usd": str(Decimal(self.rule.limit_micros) / 1_000_000),
            "limit_micros": self.rule.limit_micros,
            "period": self.rule.period.value,
            "time_zone": self.rule.time_zone,
            "thresholds": list(self.rule.thresholds_pct),
        }


@dataclass(frozen=True)
class InFlight:
    """An item whose call is released or under way: its reservation stays held."""

    item_id: int
    attempt: int
    model: str
    route: str
    prompt_tokens_est: int
    max_tokens: int

    @property
    def reservation_id(self) -> str:
        return f"{self.item_id}:{self.attempt}"


@dataclass(frozen=True)
class ItemFacts:
    route: str
    key_id: int | None


def _stored(row: MoneyBudget) -> StoredBudget:
    rule = BudgetRule(
        row.limit_micros, Period(row.period), row.time_zone, tuple(row.thresholds_pct)
    )
    return StoredBudget(row.id, row.tenant_id, row.key_id, rule)


def set_budget(
    session: Session, tenant_id: int, key_id: int | None, rule: BudgetRule
) -> tuple[StoredBudget, StoredBudget | None]:
    """Create or replace the budget of the tenant (``key_id`` None) or of its key;
    returns it and what it replaced (None: new)."""
    before = get_budget(session, tenant_id, key_id)
    values = {
        "tenant_id": tenant_id,
        "key_id": key_id,
        "limit_micros": rule.limit_micros,
        "period": rule.period.value,
        "time_zone": rule.time_zone,
        "thresholds_pct": list(rule.thresholds_pct),
    }
    changes: dict[str, Any] = {k: v for k, v in values.items() if k not in ("tenant_id", "key_id")}
    changes["updated_at"] = func.now()
    stmt = insert(MoneyBudget).values(**values)
    if key_id is None:
        stmt = stmt.on_conflict_do_update(
            index_elements=["tenant_id"], index_where=text("key_id IS NULL"), set_=changes
        )
    else:
        stmt = stmt.on_conflict_do_update(
            index_elements=["key_id"], index_where=text("key_id IS NOT NULL"), set_=changes
        )
    session.execute(stmt)
    after = get_budget(session, tenant_id, key_id)
    assert after is not None
    return after, before


def get_budget(session: Session, tenant_id: int, key_id: int | None) -> StoredBudget | None:
    key_match = MoneyBudget.key_id.is_(None) if key_id is None else MoneyBudget.key_id == key_id
    row = session.scalar(
        select(MoneyBudget)
        .where(MoneyBudget.tenant_id == tenant_id, key_match)
        .execution_options(populate_existing=True)
    )
    return None if row is None else _stored(row)


def delete_budget(session: Session, tenant_id: int, key_id: int | None) -> StoredBudget | None:
    """Remove the budget; returns what it was (None: there was none)."""
    before = get_budget(session, tenant_id, key_id)
    if before is not None:
        session.execute(delete(MoneyBudget).where(MoneyBudget.id == before.id))
    return before


def budgets_of(session: Session, tenant_ids: Collection[int]) -> dict[int, list[StoredBudget]]:
    """The budgets of each of ``tenant_ids`` that has any (its own and its keys')."""
    if not tenant_ids:
        return {}
    rows = session.scalars(
        select(MoneyBudget).where(MoneyBudget.tenant_id.in_(list(tenant_ids)))
    ).all()
    out: dict[int, list[StoredBudget]] = defaultdict(list)
    for row in rows:
        out[row.tenant_id].append(_stored(row))
    return dict(out)


def all_budgets(session: Session) -> list[StoredBudget]:
    return [_stored(r) for r in session.scalars(select(MoneyBudget).order_by(MoneyBudget.id))]


def key_of_tenant(session: Session, tenant_id: int, key_id: int) -> bool:
    """Whether ``key_id`` is one of the tenant's keys."""
    found = session.scalar(
        select(ApiKey.id).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id)
    )
    return found is not None


def spend_micros(
    session: Session, budget: StoredBudget, start: dt.datetime | None, end: dt.datetime | None
) -> int:
    """What the ledger holds of the budget's calls in ``[start, end)`` (None: unbounded),
    in micro-dollars (rounded up)."""
    stmt = select(func.coalesce(func.sum(UsageLedger.cost_usd), 0)).where(
        UsageLedger.tenant_id == budget.tenant_id
    )
    if start is not None:
        stmt = stmt.where(UsageLedger.created_at >= start)
    if end is not None:
        stmt = stmt.where(UsageLedger.created_at < end)
    if budget.key_id is not None:
        stmt = stmt.join(Batch, Batch.id == UsageLedger.batch_id).where(
            Batch.key_id == budget.key_id
        )
    return to_micros(Decimal(session.scalar(stmt) or 0))


def in_flight(session: Session, budget: StoredBudget) -> list[InFlight]:
    """The budget's items released or running now, by the attempt their call is, and
    those in a provider's job (reserved at its creation, at the batch tier)."""
    queued = and_(Item.status == ItemStatus.QUEUED.value)
    running = and_(Item.status == ItemStatus.RUNNING.value)
    in_job = and_(Item.status == ItemStatus.OFFLOADED.value, Item.job_id.is_not(None))
    stmt = select(
        Item.id,
        Item.attempts,
        Item.status,
        Item.model,
        Item.route,
        Item.prompt_tokens_est,
        Item.max_tokens,
    ).where(Item.tenant_id == budget.tenant_id, or_(queued, running, in_job))
    if budget.key_id is not None:
        stmt = stmt.join(Batch, Batch.id == Item.batch_id).where(Batch.key_id == budget.key_id)
    return [
        InFlight(
            r.id,
            r.attempts + 1 if r.status == ItemStatus.QUEUED.value else r.attempts,
            r.model,
            "batch" if r.status == ItemStatus.OFFLOADED.value else r.route,
            r.prompt_tokens_est,
            r.max_tokens,
        )
        for r in session.execute(stmt)
    ]


def batch_owner(session: Session, batch_id: str) -> tuple[int, int | None]:
    """The batch's tenant and the key it was made with."""
    row = session.execute(select(Batch.tenant_id, Batch.key_id).where(Batch.id == batch_id)).one()
    return row.tenant_id, row.key_id


def item_facts(session: Session, item_ids: Collection[int]) -> dict[int, ItemFacts]:
    """Each item's route and the key of its batch."""
    if not item_ids:
        return {}
    rows = session.execute(
        select(Item.id, Item.route, Batch.key_id)
        .join(Batch, Batch.id == Item.batch_id)
        .where(Item.id.in_(list(item_ids)))
    )
    return {r.id: ItemFacts(r.route, r.key_id) for r in rows}


def ledgered(session: Session, reservation_ids: Collection[str]) -> list[str]:
    """Of the reservation ids ``<item>:<attempt>``, those whose call has its ledger row
    (its price is in the ledger's spend); other ids are never ledgered ones."""
    pairs: list[tuple[int, int]] = []
    for rid in reservation_ids:
        item, _, attempt = rid.partition(":")
        if item.isdigit() and attempt.isdigit():
            pairs.append((int(item), int(attempt)))
    if not pairs:
        return []
    rows = session.execute(
        select(UsageLedger.item_id, UsageLedger.attempt).where(
            UsageLedger.item_id.in_({i for i, _ in pairs}),
        )
    )
    found = {(r.item_id, r.attempt) for r in rows}
    return [f"{i}:{a}" for i, a in pairs if (i, a) in found]


def tenant_names(session: Session, tenant_ids: Collection[int]) -> dict[int, str]:
    if not tenant_ids:
        return {}
    rows = session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(list(tenant_ids))))
    return {r.id: r.name for r in rows}


def tenant_webhook(session: Session, tenant_id: int) -> tuple[str, str | None, str | None]:
    """The tenant's name, webhook URL and secret (the id as name if it is gone)."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        return str(tenant_id), None, None
    return tenant.name, tenant.webhook_url, tenant.webhook_secret


def tenants_with_budgets(session: Session) -> frozenset[int]:
    """The tenants that have a budget (their own or one of their keys')."""
    return frozenset(session.scalars(select(MoneyBudget.tenant_id).distinct()))
