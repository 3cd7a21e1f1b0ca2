"""Dollar budgets at work: reserve before a call, hold a tenant its budget cannot
cover, rebuild from the ledger (docs/money.md).

A call counts against its tenant's budget and its key's (if they have one). Before
it may go, its worst-case price (:func:`batchgen.domain.billing.budget_maths.worst_case_micros`, at
the tier of its route) is reserved in each, all or nothing
(:class:`batchgen.limits.money_budgets.MoneyBudgets`):

* a batch item when the dispatcher releases it (:func:`admit_picks`, called by
  :func:`batchgen.store.rounds.release` in the release's transaction): refused, the
  item goes back to pending unsent and its tenant is held (``budget_holds``) for
  ``money_hold_s``, not billed, not failed;
* a synchronous call before it is stored (:func:`reserve_call`): refused, it gets 429
  ``budget_exhausted`` with the period's reset time; stored, its reservation moves to
  its item's id (:func:`adopt_call`);
* an offloaded job's rows before the job is created (:func:`reserve_job`, at the
  batch tier): refused, the job is not created and its items go back online.

Each reservation is settled right after its call's ledger row commits
(:mod:`batchgen.worker.money_settle`): released, its actual price added to ``used``,
once. A rebuild of its budget (:func:`sync_budget`: whenever a reservation is
refused, and for every budget on the beat's tick) is the safety net: ``used`` becomes
the ledger's spend and what ended is released, in one script; what is in flight stays
held (added if Redis lost it). So a budget is never passed, whatever dies meanwhile:
a reservation outlives its call until its price is in ``used``.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from batchgen.config import Settings, get_settings
from batchgen.domain.billing import budget_maths as rules
from batchgen.domain.formats.admission import validate_line
from batchgen.domain.scheduling.routes import ItemRoute
from batchgen.errors import BudgetExhausted, ValidationFailed
from batchgen.limits.backend import REDIS_DOWN, get_redis
from batchgen.limits.money_budgets import Ask, Level, MoneyBudgets, Settle
from batchgen.limits.redis_keys import money as money_key
from batchgen.registry import Registry, Tier, get_registry
from batchgen.store import budget_rows as store
from batchgen.store import items, rounds, tenants
from batchgen.store.budget_rows import StoredBudget
from batchgen.store.db import session_scope
from batchgen.store.schema import Tenant
from batchgen.worker.money_alerts import Alert, fire

log = logging.getLogger(__name__)

# How long a period's hash outlives its end (a total budget's: from its last use).
KEEP_AFTER_PERIOD_S = 2 * 86_400.0
KEEP_TOTAL_S = 90 * 86_400.0


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _ttl_s(win: rules.Window, now: dt.datetime) -> float:
    left = win.seconds_left(now)
    return KEEP_TOTAL_S if left is None else left + KEEP_AFTER_PERIOD_S


def applicable(budgets: Iterable[StoredBudget], key_id: int | None) -> list[StoredBudget]:
    """The budgets a call made with ``key_id`` counts against: its tenant's and its key's."""
    return [b for b in budgets if b.key_id is None or b.key_id == key_id]


def worst_case(registry: Registry, model: str, prompt_est: int, max_tokens: int, tier: Tier) -> int:
    spec = registry.get(model)
    if spec is None:
        return 0
    margin = get_settings().money.prompt_margin
    return rules.worst_case_micros(spec, prompt_est, max_tokens, tier, margin)


def _tier(route: str | None) -> Tier:
    try:
        return ItemRoute(route).tier if route else Tier.STANDARD
    except ValueError:
        return Tier.STANDARD


def sync_budget(
    session: Session,
    budget: StoredBudget,
    *,
    mb: MoneyBudgets | None = None,
    registry: Registry | None = None,
    settings: Settings | None = None,
    now: dt.datetime | None = None,
    exclude: Collection[int] = (),
) -> Level:
    """Rebuild the budget's period from the ledger (its spend) and the items in flight
    (held at their worst case); reservations ledgered or ended are released (those
    younger than ``money_sync_grace_s`` only if ledgered). ``exclude``: items of the
    caller's own uncommitted release, not yet admitted. Fires the thresholds reached."""
    mb = mb or MoneyBudgets(get_redis())
    registry = registry or get_registry()
    settings = settings or get_settings()
    now = now or _now()
    win = rules.window(budget.rule.period, budget.rule.time_zone, now)
    key = money_key(budget.tenant_id, budget.id, win.key)
    cutoff_s = mb.now_s() - settings.money.sync_grace_s
    flying = [
        (
            f.reservation_id,
            worst_case(registry, f.model, f.prompt_tokens_est, f.max_tokens, _tier(f.route)),
        )
        for f in store.in_flight(session, budget)
        if f.item_id not in exclude
    ]
    flying_ids = {rid for rid, _ in flying}
    held = [rid for rid in mb.held(key) if rid not in flying_ids]
    done = store.ledgered(session, held)
    # The spend last: a row committed after it was read is a call counted in flight.
    spend = store.spend_micros(session, budget, win.start, win.end)
    level = mb.sync(key, spend, cutoff_s, flying, _ttl_s(win, now), done=done)
    _fire_alerts(mb, budget, win, level, now)
    return level


def _fire_alerts(
    mb: MoneyBudgets, budget: StoredBudget, win: rules.Window, level: Level, now: dt.datetime
) -> None:
    reached = rules.reached(level.used_micros, budget.rule.limit_micros, budget.rule.thresholds_pct)
    for pct in reached:
        if not mb.alert_once(budget.tenant_id, budget.id, win.key, pct, _ttl_s(win, now)):
            continue
        fire(Alert(budget, win.key, pct, level.used_micros, budget.rule.limit_micros, win.end))


@dataclass(frozen=True)
class Refusal:
    budget: StoredBudget
    window: rules.Window


def _asks(
    budgets: Sequence[StoredBudget], amount: int, now: dt.datetime
) -> tuple[list[Ask], list[rules.Window]]:
    wins = [rules.window(b.rule.period, b.rule.time_zone, now) for b in budgets]
    asks = [
        Ask(money_key(b.tenant_id, b.id, w.key), amount, b.rule.limit_micros)
        for b, w in zip(budgets, wins, strict=True)
    ]
    return asks, wins


def reserve(
    session: Session,
    budgets: Sequence[StoredBudget],
    reservation_id: str,
    amount_micros: int,
    *,
    mb: MoneyBudgets | None = None,
    now: dt.datetime | None = None,
    exclude: Collection[int] = (),
) -> Refusal | None:
    """Reserve ``amount_micros`` in every one of ``budgets`` (all or nothing); refused or
    a period not built yet, rebuild the budgets from the ledger and try once more.
    Returns None when reserved, else the budget that refused."""
    if not budgets:
        return None
    mb = mb or MoneyBudgets(get_redis())
    now = now or _now()
    asks, wins = _asks(budgets, amount_micros, now)
    ttl_s = max(_ttl_s(w, now) for w in wins)
    reply = mb.reserve(budgets[0].tenant_id, reservation_id, asks, ttl_s)
    if reply.granted:
        return None
    for b in budgets:
        sync_budget(session, b, mb=mb, now=now, exclude=exclude)
    reply = mb.reserve(budgets[0].tenant_id, reservation_id, asks, ttl_s)
    if reply.granted:
        return None
    return Refusal(budgets[reply.index], wins[reply.index])


def admit_picks(session: Session, model: str, picks: Sequence[items.Pick]) -> set[int]:
    """The dispatcher's check, in its release's transaction: reserve each pick's worst
    case in its tenant's and key's budgets, in release order; returns the item ids
    refused: from the first refusal on, all of that tenant's picks (the tenant held for
    ``money_hold_s``), or, refused by a key's budget, all of that key's (the tenant's
    other keys go on). Redis unreachable: every pick of a tenant with a budget is
    refused (nothing goes unreserved)."""
    if not picks:
        return set()
    tenant_budgets = store.budgets_of(session, {p.ticket.tenant_id for p in picks})
    if not tenant_budgets:
        return set()
    mine = [p for p in picks if p.ticket.tenant_id in tenant_budgets]
    candidates = {p.ticket.item_id for p in mine}
    facts = store.item_facts(session, candidates)
    settings, registry, now = get_settings(), get_registry(), _now()
    refused: set[int] = set()
    stopped: dict[int, float] = {}  # tenants their own budget refused: held
    stopped_keys: set[tuple[int, int | None]] = set()  # keys their budget refused
    try:
        mb = MoneyBudgets(get_redis())
        for p in mine:
            t = p.ticket
            fact = facts.get(t.item_id)
            key_id = fact.key_id if fact else None
            if t.tenant_id in stopped or (t.tenant_id, key_id) in stopped_keys:
                refused.add(t.item_id)
                continue
            budgets = applicable(tenant_budgets[t.tenant_id], key_id)
            if not budgets:
                continue
            amount = worst_case(
                registry,
                model,
                t.prompt_tokens_est,
                t.max_tokens,
                _tier(fact.route if fact else None),
            )
            refusal = reserve(
                session,
                budgets,
                f"{t.item_id}:{t.attempt}",
                amount,
                mb=mb,
                now=now,
                exclude=candidates,
            )
            if refusal is None:
                continue
            refused.add(t.item_id)
            if refusal.budget.key_id is not None:
                # Only this key's items wait: the tenant's other keys go on.
                stopped_keys.add((t.tenant_id, key_id))
                continue
            left = refusal.window.seconds_left(now)
            hold = settings.money.hold_s if left is None else min(settings.money.hold_s, left)
            stopped[t.tenant_id] = max(0.05, hold)
    except REDIS_DOWN:
        log.warning("Redis unreachable: the tenants with dollar budgets wait")
        for p in mine:
            refused.add(p.ticket.item_id)
            stopped.setdefault(p.ticket.tenant_id, settings.money.hold_s)
    for tenant_id, hold_s in stopped.items():
        rounds.hold_tenant(session, tenant_id, hold_s)
    return refused


def reserve_job(
    session: Session, batch_id: str, model: str, rows: Sequence[tuple[int, int, int, int]]
) -> bool:
    """Before an offloaded job is created: reserve each of its rows ``(item, attempt,
    prompt estimate, max_tokens)`` at its worst case at the batch tier, all or none;
    their ledger rows settle them as the job's results are recorded. False: the job
    would overspend (nothing stays reserved; its items wait offloaded, held, as a
    batch item waits pending). Redis unreachable: False for a tenant with a budget."""
    tenant_id, key_id = store.batch_owner(session, batch_id)
    budgets = applicable(store.budgets_of(session, [tenant_id]).get(tenant_id, []), key_id)
    if not budgets:
        return True
    registry, now = get_registry(), _now()
    done: list[Settle] = []
    # The job's items are in it already: a rebuild must not count them in flight.
    mine = {item_id for item_id, *_ in rows}
    try:
        mb = MoneyBudgets(get_redis())
        for item_id, attempt, prompt_est, max_tokens in rows:
            rid = f"{item_id}:{attempt}"
            amount = worst_case(registry, model, prompt_est, max_tokens, Tier.BATCH)
            if reserve(session, budgets, rid, amount, mb=mb, now=now, exclude=mine) is not None:
                mb.release(done)
                return False
            done.append(Settle(tenant_id, rid, 0))
    except REDIS_DOWN:
        log.warning("Redis unreachable: offloaded jobs of tenants with budgets wait")
        return False
    return True


@dataclass(frozen=True)
class HeldCall:
    """A synchronous call's reservation before its item exists."""

    tenant_id: int
    reservation_id: str


def reserve_call(
    line: dict[str, Any], *, tenant: Any, key_id: int | None, endpoint: str
) -> HeldCall | None:
    """Before a synchronous call is stored: reserve its worst case in its tenant's and
    key's budgets, under an id of its own, moved to its item's ``<item>:<attempt>`` once
    it is stored (:func:`adopt_call`), then settled when it is ledgered. Refused:
    :class:`BudgetExhausted` (429) with the period's reset. Returns the reservation
    (None: no budget applies, or the line is invalid: storing it refuses it)."""
    registry = get_registry()
    with session_scope() as session:
        # A tenant this request authenticated is read already (its id is all it takes).
        owner_id = tenant.id if isinstance(tenant, Tenant) else tenants.find(session, tenant).id
        budgets = applicable(store.budgets_of(session, [owner_id]).get(owner_id, []), key_id)
        if not budgets:
            return None
        try:
            raw = _line_bytes(line, endpoint)
            draft = validate_line(raw, 1, registry, endpoint=endpoint)
        except ValidationFailed:
            return None
        body = line.get("body") or {}
        tier = Tier.FLEX if body.get("service_tier") == "flex" else Tier.STANDARD
        amount = worst_case(registry, draft.model, draft.prompt_tokens_est, draft.max_tokens, tier)
        rid = f"c:{uuid.uuid4().hex}"
        now = _now()
        refusal = reserve(session, budgets, rid, amount, now=now)
    if refusal is None:
        return HeldCall(owner_id, rid)
    resets = refusal.window.end
    retry_after = rules.retry_after_s(refusal.window, now)
    scope = "its key's" if refusal.budget.key_id is not None else "the tenant's"
    raise BudgetExhausted(
        f"{scope} {refusal.budget.rule.period.value} budget of "
        f"${rules.to_usd(refusal.budget.rule.limit_micros)} cannot cover this call's "
        f"worst-case price of ${rules.to_usd(amount)}"
        + (f"; it resets at {resets.isoformat()}" if resets else ""),
        retry_after_s=retry_after,
        resets_at=resets.isoformat() if resets else None,
    )


def adopt_call(held: HeldCall, item_id: int, attempt: int) -> None:
    """Move a synchronous call's reservation to its item's id, so that its ledger row
    settles it and a rebuild counts it once. Redis away: the rebuild releases the call's
    own id after ``money_sync_grace_s`` (meanwhile it is counted twice, never less)."""
    try:
        MoneyBudgets(get_redis()).adopt(held.tenant_id, held.reservation_id, f"{item_id}:{attempt}")
    except REDIS_DOWN:
        log.warning("Redis unreachable: call item %d keeps its own reservation", item_id)


def _line_bytes(line: dict[str, Any], endpoint: str) -> bytes:
    import json

    full = {"custom_id": "call", "method": "POST", "url": endpoint, **line}
    full.setdefault("custom_id", "call")
    return json.dumps(full, ensure_ascii=False).encode("utf-8")


def sync_all(now: dt.datetime | None = None) -> int:
    """Rebuild every budget's period from the ledger (the beat's tick); returns how many."""
    mb = MoneyBudgets(get_redis())
    with session_scope() as session:
        budgets = store.all_budgets(session)
        for b in budgets:
            sync_budget(session, b, mb=mb, now=now)
    return len(budgets)


def status(tenant_id: int, now: dt.datetime | None = None) -> list[dict[str, Any]]:
    """Each budget of the tenant: its limit, period, what is used and reserved now."""
    now = now or _now()
    mb = MoneyBudgets(get_redis())
    out = []
    with session_scope() as session:
        for b in store.budgets_of(session, [tenant_id]).get(tenant_id, []):
            level = sync_budget(session, b, mb=mb, now=now)
            win = rules.window(b.rule.period, b.rule.time_zone, now)
            out.append(
                {
                    **b.as_dict(),
                    "period_key": win.key,
                    "resets_at": win.end.isoformat() if win.end else None,
                    "used_micros": level.used_micros,
                    "reserved_micros": level.reserved_micros,
                    "used_usd": str(rules.to_usd(level.used_micros)),
                }
            )
    return out
