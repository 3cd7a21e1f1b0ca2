"""The exactly-once recording of results and usage: results, the ledger, daily totals.

One ledger row per (item, attempt) that may have been billed (``UNIQUE (item_id,
attempt)``, ``ON CONFLICT DO NOTHING``), written after locking the item row, in
the same transaction as the result and the daily totals. The item's own state
moves go through :mod:`batchgen.store.items`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, TextClause, bindparam, event
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from batchgen.domain.billing.cost import TokenUsage, cost_usd, price_usage, tier_of, usage_of
from batchgen.domain.formats.stream_usage import ReportedUsage, UsageSource
from batchgen.domain.lifecycle.status import TERMINAL, ItemStatus
from batchgen.domain.scheduling.offload import Route
from batchgen.registry import ModelSpec, Registry, Tier
from batchgen.store import items
from batchgen.store.items import Answered, Claimed, LockedItem
from batchgen.store.schema import DAILY_USAGE_SHARDS
from batchgen.store.sqlfiles import query


@functools.cache
def _result_insert() -> TextClause:
    return query("result_insert").bindparams(bindparam("response", type_=JSONB))


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
    # The deployment of the model that served the call (None: the item's, as recorded
    # when its current attempt was sent).
    deployment: str | None = None
    # The tier the call asked for (its route's): the answer's own word wins.
    tier: Tier = Tier.STANDARD
    # The provider's usage, or an estimate (no usage came back).
    usage_source: UsageSource = UsageSource.PROVIDER

    @property
    def usage(self) -> TokenUsage:
        """The call's tokens by kind, as the provider's answer reports them."""
        return usage_of(self.prompt_tokens, self.completion_tokens, self.response)

    def kinds(self) -> dict[str, int]:
        """The token kinds beside prompt and completion, as the ledger's columns."""
        usage = self.usage
        return {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
            "reasoning_tokens": usage.reasoning_tokens,
        }


# Waste rows written without the provider's answer, because the worker that sent
# the call was lost (its lease ran out) or another attempt finished the item while
# this one was in flight. Their usage is the provider's where its stream reported it
# before the process died, else what the call reserved (an estimate, marked so); if
# the answer still comes, it replaces that in place (never a second row for one call).
LOST_CALL = "worker_lost"
SUPERSEDED_CALL = "superseded_in_flight"
ESTIMATED = frozenset({LOST_CALL, SUPERSEDED_CALL})


def _shard(item_id: int) -> int:
    return item_id % DAILY_USAGE_SHARDS


@dataclass(frozen=True)
class Priced:
    """What a call costs, by which route it was made and at which tier (an offline row
    is priced at the batch prices; ``online_cost`` is what it would have cost online)."""

    cost: Decimal
    route: Route = Route.ONLINE
    online_cost: Decimal | None = None
    tier: Tier = Tier.STANDARD


def price(outcome: CallOutcome, spec: ModelSpec, route: Route = Route.ONLINE) -> Priced:
    """The price of ``outcome``'s usage by ``route``, at the tier it was served at (an
    offline row at batch; an online one at the tier its answer says, else the one its
    call asked for: :func:`batchgen.domain.billing.cost.tier_of`; ``online_cost`` of an offline
    row at the standard tier)."""
    usage = outcome.usage
    tier = tier_of(route is Route.OFFLINE, outcome.response, outcome.tier)
    billed = price_usage(usage, spec, tier)
    if route is Route.ONLINE:
        return Priced(billed, tier=tier)
    return Priced(billed, Route.OFFLINE, price_usage(usage, spec), tier)


def _params(item: LockedItem, outcome: CallOutcome, priced: Priced, waste: str | None) -> dict:
    return {
        "item_id": item.id,
        "attempt": outcome.attempt,
        "tenant_id": item.tenant_id,
        "batch_id": item.batch_id,
        "model": item.model,
        "shard": _shard(item.id),
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        **outcome.kinds(),
        "cost_usd": priced.cost,
        "tier": priced.tier.value,
        "waste_reason": waste,
        "deployment": outcome.deployment or item.deployment,
        "usage_source": outcome.usage_source.value,
    }


@dataclass(frozen=True)
class Ledgered:
    """A ledger row just written: what settles its call's dollar reservation
    (``<item>:<attempt>``) once its transaction commits (batchgen.worker.money_settle)."""

    tenant_id: int
    item_id: int
    attempt: int
    cost_usd: Decimal

    @property
    def reservation_id(self) -> str:
        return f"{self.item_id}:{self.attempt}"


# session.info's list of the rows its transaction ledgered (taken at commit).
LEDGERED = "batchgen.ledgered"


def take_ledgered(session: Session) -> list[Ledgered]:
    """The rows ``session``'s transaction ledgered, taken (each settled once)."""
    found: list[Ledgered] = session.info.pop(LEDGERED, [])
    return found


_settlers: list[Callable[[list[Ledgered]], object]] = []


def on_commit(settle: Callable[[list[Ledgered]], object]) -> None:
    """Hand ``settle`` what each session's transaction ledgered, once it commits (once
    per process, whoever asks again)."""
    if settle in _settlers:
        return
    if not _settlers:
        event.listen(Session, "after_commit", _committed)
        event.listen(Session, "after_rollback", take_ledgered)
    _settlers.append(settle)


def _committed(session: Session) -> None:
    rows = take_ledgered(session)
    if rows:
        for settle in _settlers:
            settle(rows)


def answered_row(item: Claimed, outcome: CallOutcome, spec: ModelSpec) -> Ledgered:
    """The ledger row :func:`record_answer` wrote (its transaction committed with it)."""
    return Ledgered(item.tenant_id, item.item_id, outcome.attempt, price(outcome, spec).cost)


def _ledger(
    session: Session,
    item: LockedItem,
    outcome: CallOutcome,
    cost: Decimal | Priced,
    waste: str | None,
) -> bool:
    """Insert the ledger row for (item, attempt) once; daily totals follow it (one statement)."""
    priced = cost if isinstance(cost, Priced) else Priced(cost)
    params = _params(item, outcome, priced, waste)
    params.update(route=priced.route.value, online_cost_usd=priced.online_cost)
    inserted = session.execute(query("ledger_insert"), params).scalar_one_or_none()
    if inserted is not None:
        row = Ledgered(item.tenant_id, item.id, outcome.attempt, priced.cost)
        session.info.setdefault(LEDGERED, []).append(row)
    return inserted is not None


def _replace_estimate(
    session: Session, item: LockedItem, outcome: CallOutcome, priced: Priced, waste: str | None
) -> bool:
    """The answer of a call ledgered as an estimate arrived after all: its row takes the
    real usage (and becomes the result's row when ``waste`` is None), the daily totals
    of the row's day follow. False when (item, attempt) has no estimated row."""
    replaced = session.execute(
        query("ledger_replace_estimate"), _params(item, outcome, priced, waste)
    ).scalar_one_or_none()
    return replaced is not None


def _estimate(
    item: LockedItem, attempt: int, spec: ModelSpec | None
) -> tuple[CallOutcome, Decimal]:
    """A sent call whose usage we do not have: what it reserved, the prompt estimate and
    its ``max_tokens`` (the most the provider may bill it)."""
    prompt, completion = item.prompt_tokens_est, item.max_tokens
    outcome = CallOutcome(
        item_id=item.id,
        attempt=attempt,
        prompt_tokens=prompt,
        completion_tokens=completion,
        usage_source=UsageSource.ESTIMATE,
    )
    cost = cost_usd(prompt, completion, spec) if spec is not None else Decimal(0)
    return outcome, cost


def _reported(
    item: LockedItem, attempt: int, usage: ReportedUsage, spec: ModelSpec | None
) -> tuple[CallOutcome, Decimal]:
    """A sent call whose answer we do not have, but whose usage its stream reported."""
    outcome = CallOutcome(
        item_id=item.id,
        attempt=attempt,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        response=usage.body,
    )
    return outcome, price(outcome, spec).cost if spec is not None else Decimal(0)


def record_lost_call(
    session: Session,
    item_id: int,
    attempt: int,
    registry: Registry,
    usage: ReportedUsage | None = None,
) -> bool:
    """Ledger as waste a sent call whose worker was lost (once per (item, attempt)):
    with the ``usage`` its provider reported, else with what it reserved."""
    item = items.lock(session, item_id, for_update=False)
    assert item is not None
    spec = registry.get(item.model)
    if usage is not None:
        outcome, cost = _reported(item, attempt, usage, spec)
    else:
        outcome, cost = _estimate(item, attempt, spec)
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


def record_answer(
    connection: Connection, item: Claimed, outcome: CallOutcome, spec: ModelSpec
) -> Answered:
    """The common case of :func:`record_success` in one statement (autocommit): this
    attempt is still running, nothing of it ledgered. ``recorded`` False: nothing was
    written, and :func:`record_success` decides what the answer is."""
    priced = price(outcome, spec)
    return items.succeed_answered(
        connection,
        {
            "item_id": item.item_id,
            "attempt": outcome.attempt,
            "tenant_id": item.tenant_id,
            "batch_id": item.batch_id,
            "model": item.model,
            "shard": _shard(item.item_id),
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            **outcome.kinds(),
            "cost_usd": priced.cost,
            "tier": priced.tier.value,
            "response": outcome.response,
            "provider_request_id": outcome.provider_request_id,
            "upstream_latency_ms": outcome.upstream_latency_ms,
            "queue_wait_ms": outcome.queue_wait_ms,
            "route": Route.ONLINE.value,
            "online_cost_usd": None,
            "deployment": outcome.deployment,
        },
    )


def record_answers(
    connection: Connection, answers: Sequence[tuple[Claimed, CallOutcome, ModelSpec]]
) -> dict[int, Answered]:
    """:func:`record_answer` for a group of a pack's answers in one statement (a group
    commit, autocommit): each recorded only in the common case (its attempt still runs
    the item, nothing of it ledgered). An answer whose ``recorded`` is False wrote
    nothing: :func:`record_success` decides what it is, alone."""
    if not answers:
        return {}
    rows = []
    for item, outcome, spec in answers:
        priced = price(outcome, spec)
        rows.append(
            {
                "item_id": item.item_id,
                "attempt": outcome.attempt,
                "tenant_id": item.tenant_id,
                "batch_id": item.batch_id,
                "model": item.model,
                "prompt_tokens": outcome.prompt_tokens,
                "completion_tokens": outcome.completion_tokens,
                **outcome.kinds(),
                "cost_usd": priced.cost,
                "tier": priced.tier.value,
                "response": outcome.response,
                "provider_request_id": outcome.provider_request_id,
                "upstream_latency_ms": outcome.upstream_latency_ms,
                "queue_wait_ms": outcome.queue_wait_ms,
                "deployment": outcome.deployment,
            }
        )
    # One shard of the daily totals for the whole group: its rows add up into one row
    # per tenant, day, model and deployment (the shards only spread concurrent writers).
    return items.succeed_answered_many(connection, rows, _shard(answers[0][0].item_id))


def record_success(
    session: Session, outcome: CallOutcome, spec: ModelSpec, route: Route = Route.ONLINE
) -> bool:
    """Record a successful call exactly once, in the caller's transaction (``route``
    offline: a row of a provider job, priced at the batch prices).

    The item row is locked first, so a duplicate run of the same item waits
    and then sees the first one's verdict. Returns True when this call's
    result became the item's result; False when the call was wasted (the item
    already finished, or it was re-leased to another attempt), in which case
    it is still written to the ledger, marked as waste.
    """
    item = items.lock(session, outcome.item_id)
    assert item is not None
    priced = price(outcome, spec, route)
    cost = priced.cost
    if item.status in TERMINAL:
        waste = f"item_already_{item.status.value}"
        if not _ledger(session, item, outcome, priced, waste):
            _replace_estimate(session, item, outcome, priced, waste)
        return False
    # Not terminal: even if our lease ran out and the item went back to the
    # queue, the answer is good; it becomes the result and the newer attempt
    # will find the item finished when it claims it. If the sweep ledgered this
    # call as lost meanwhile, that row becomes the result's row.
    recorded = _ledger(session, item, outcome, priced, None) or _replace_estimate(
        session, item, outcome, priced, None
    )
    if not recorded:
        return False  # this very attempt was already recorded
    _supersede(session, item, outcome.attempt, spec)
    session.execute(
        _result_insert(),
        {
            "item_id": item.id,
            "batch_id": item.batch_id,
            "tenant_id": item.tenant_id,
            "attempt": outcome.attempt,
            "response": outcome.response,
            "provider_request_id": outcome.provider_request_id,
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            **outcome.kinds(),
            "cost_usd": cost,
            "upstream_latency_ms": outcome.upstream_latency_ms,
            "queue_wait_ms": outcome.queue_wait_ms,
        },
    )
    items.succeed(session, item.id)
    return True


def record_waste(
    session: Session,
    outcome: CallOutcome,
    spec: ModelSpec,
    reason: str,
    route: Route = Route.ONLINE,
) -> None:
    """Ledger a billed call that produced no result (cancelled mid-call, malformed...).

    The item row is locked first, as every other writer of an item and its ledger
    does (:func:`record_success`, the sweep): the ledger row's daily totals lock a
    row shared by many items, and taking it before the item's own lock, with the
    item's state move still to come in the same transaction, deadlocked against a
    writer holding the item and wanting the same daily row."""
    item = items.lock(session, outcome.item_id)
    assert item is not None
    _ledger(session, item, outcome, price(outcome, spec, route), reason)
