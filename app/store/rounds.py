"""A dispatch round's reads and writes: the model's ring of tenants with ready work, where
it stands between rounds, and each tenant's dispatch clock.

Who gets how many of the model's free places is decided by deficit round robin
(:mod:`batchgen.domain.scheduling.round_robin`); this module gives it the tenants it can reach
from the ring's position (:file:`sql/dispatch_ring.sql`, a skip scan: a probe of the
ready-items index per tenant found) and releases each served tenant's items in its
own order (:func:`batchgen.store.items.release_picks`). The set of tenants with ready
work is the index itself, kept by PostgreSQL with the items: nothing to keep in step.

A tenant held back by its own budget (``budget_holds``, written when the budget defers
one of its items: :func:`hold_tenant`) is passed over by the round until its budget
frees, so the places it cannot use go to the other tenants at once.

Within a tenant, interactive items go before bulk ones, and its open batches of one
priority take turns: a batch's items are keyed from the tenant's dispatch clock on the
model at submit (:func:`next_keys`), so batch 100 starts alongside what batches 1 to 99
have left rather than behind it. Among a round's picks of one tenant and priority, the
items sharing a cached prompt prefix (``items.prefix_key``) are released together.

Several dispatchers are safe: the model's advisory lock makes the window's count, the
ring's position and the release one critical section, and ``FOR UPDATE SKIP LOCKED``
never releases an item twice.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from batchgen.domain.scheduling.round_robin import Member, Turn, ring_order, run_round
from batchgen.store import items
from batchgen.store.schema import BudgetHold, DispatchClock, DispatchRing
from batchgen.store.sqlfiles import query

_LOWEST_ID = -(2**63)
# (session, model, picks) -> the item ids refused.
Admit = Callable[[Session, str, Sequence[items.Pick]], set[int]]
_BEYOND_ID = 2**63 - 1


def release(
    session: Session,
    model: str,
    window: int,
    queued_lease_s: float,
    admit: Admit | None = None,
) -> list[items.Ticket]:
    """``pending → queued`` for up to the model's free places in its window of
    ``window`` items, by deficit round robin across the tenants with ready work; returns
    the tickets (what each message carries) in release order. ``admit`` (the dollar
    budgets: :func:`batchgen.worker.money_holds.admit_picks`) sees each take's picks in this
    transaction and names those it refuses: they go back to pending unsent, and their
    tenant, found dry, is passed over for the rest of the round."""
    if not items.lock_model(session, model):
        return []  # another dispatcher is releasing this model right now
    free = window - items.in_flight(session, model)
    if free <= 0:
        return []
    items.ready_due(session, model, limit=max(free, items.READY_DUE_PER_ROUND))
    turn = _turn(session, model)

    def read_ring(start: int, limit: int) -> tuple[list[Member], bool]:
        found = _ring(session, model, start, _BEYOND_ID, limit)
        if len(found) < limit:
            found += _ring(session, model, _LOWEST_ID, start, limit - len(found))
        order = ring_order((m.tenant_id for m in found), start)
        weight = {m.tenant_id: m.weight for m in found}
        return [Member(t, weight[t]) for t in order], len(found) < limit

    def take(wanted: dict[int, int]) -> dict[int, list[items.Pick]]:
        picks: dict[int, list[items.Pick]] = defaultdict(list)
        released = items.release_picks(session, model, wanted, queued_lease_s)
        if admit is not None and released:
            refused = admit(session, model, released)
            if refused:
                items.unrelease(session, sorted(refused))
                released = [p for p in released if p.ticket.item_id not in refused]
        for pick in released:
            picks[pick.ticket.tenant_id].append(pick)
        return picks

    released, after = run_round(
        read_ring, take, turn, free, group=items.Pick.cache_group, held=_held(session)
    )
    if after != turn:
        _save_turn(session, model, after)
    return [pick.ticket for pick in released]


def _ring(session: Session, model: str, lo: int, hi: int, limit: int) -> list[Member]:
    params = {"model": model, "lo": lo, "hi": hi, "limit": limit}
    return [Member(r.tenant_id, r.weight) for r in session.execute(query("dispatch_ring"), params)]


def hold_tenant(session: Session, tenant_id: int, wait_s: float) -> None:
    """The tenant's own budget turned an item away for ``wait_s``: dispatch rounds pass
    the tenant over until then."""
    session.execute(query("budget_hold"), {"tenant_id": tenant_id, "wait_s": wait_s})


def _held(session: Session) -> set[int]:
    """The tenants whose own budget holds them back now."""
    rows = session.execute(select(BudgetHold.tenant_id).where(BudgetHold.held_until > func.now()))
    return set(rows.scalars())


def _turn(session: Session, model: str) -> Turn:
    row = session.execute(
        select(DispatchRing.start_tenant_id, DispatchRing.left_items).where(
            DispatchRing.model == model
        )
    ).one_or_none()
    return Turn() if row is None else Turn(row.start_tenant_id, row.left_items)


def _save_turn(session: Session, model: str, turn: Turn) -> None:
    stmt = insert(DispatchRing).values(
        model=model, start_tenant_id=turn.start, left_items=turn.left
    )
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=["model"],
            set_={"start_tenant_id": turn.start, "left_items": turn.left},
        )
    )


def next_keys(session: Session, tenant_id: int) -> dict[str, int]:
    """The tenant's dispatch clock per model: a new batch's items of that model are keyed
    from the clock + 1 on, in input order (a model it never released on: from 1)."""
    rows = session.execute(
        select(DispatchClock.model, DispatchClock.released_key).where(
            DispatchClock.tenant_id == tenant_id
        )
    )
    return {model: key + 1 for model, key in rows}
