"""Every state move of an item row: the one place that writes ``items.status``.

Each move is declared once (:data:`MOVES`) with the states it starts from and
the state it ends in; the declaration is checked against
:data:`batchgen.domain.lifecycle.status.TRANSITIONS` when this module is imported, and
the WHERE clause of the move is built from its declared sources, so a
duplicate delivery, a cancelled or a finished item simply matches nothing.
The SQL files this module loads (``sql/sweep_*.sql``, ``sql/item_*.sql``) are loaded
by nobody else.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from psycopg.types.json import Jsonb
from sqlalchemy import Connection, func, or_, select, text, update
from sqlalchemy.orm import Session

from batchgen import json_codec
from batchgen.domain.lifecycle.deadlines import carried_forward
from batchgen.domain.lifecycle.status import (
    CALL_RANK,
    IN_FLIGHT,
    OPEN,
    ItemStatus,
    can_move,
    values,
)
from batchgen.store import db
from batchgen.store.db import ADVISORY_NAMESPACE
from batchgen.store.schema import Item, Tenant
from batchgen.store.sqlfiles import driver_query, query

S = ItemStatus


@dataclass(frozen=True)
class Move:
    """One kind of state change: from any of ``sources`` to one of ``targets``."""

    name: str
    sources: frozenset[ItemStatus]
    targets: frozenset[ItemStatus]

    def where(self) -> Any:
        """The status condition of the move's UPDATE."""
        return Item.status.in_(values(self.sources))

    def params(self, target: ItemStatus | None = None) -> dict[str, Any]:
        """Bind parameters ``:sources`` and ``:target`` of a hand-written statement
        (``status = ANY(:sources)``): the declaration is what the SQL checks."""
        if target is None:
            (target,) = self.targets
        if target not in self.targets:
            raise ValueError(f"move {self.name!r} cannot end in {target}")
        return {"sources": values(self.sources), "target": target.value}


MOVES: dict[str, Move] = {}


def _declare(name: str, sources: set[ItemStatus], targets: set[ItemStatus]) -> Move:
    """Register a move; every (source, target) pair must be a legal transition."""
    illegal = [(s, t) for s in sources for t in targets if not can_move(s, t)]
    if illegal:
        raise AssertionError(f"move {name!r} makes illegal transitions: {illegal}")
    move = Move(name, frozenset(sources), frozenset(targets))
    MOVES[name] = move
    return move


RELEASE = _declare("release", {S.PENDING}, {S.QUEUED})
CLAIM = _declare("claim", {S.QUEUED}, {S.RUNNING})
# A released item whose dollar budget cannot cover its call goes back, unsent, before
# the dispatcher's transaction commits (batchgen.worker.money_holds).
UNRELEASE = _declare("unrelease", {S.QUEUED}, {S.PENDING})
EXPIRE_UNSTARTED = _declare("expire_unstarted", {S.PENDING, S.QUEUED}, {S.EXPIRED})
REQUEUE = _declare("requeue", {S.RUNNING}, {S.QUEUED})
# A call failed on one deployment of the model: on to another (sql/item_failover.sql).
FAILOVER = _declare("failover", {S.RUNNING}, {S.QUEUED})
DEFER = _declare("defer", {S.RUNNING}, {S.PENDING})
RETRY_LATER = _declare("retry_later", {S.RUNNING}, {S.PENDING})
# A flex call refused as busy: flex again after a wait, or a standard call
# (sql/item_reroute.sql); the attempt is handed back.
REROUTE = _declare("reroute", {S.RUNNING}, {S.QUEUED, S.PENDING})
FINISH = _declare("finish", {S.RUNNING}, {S.FAILED, S.EXPIRED, S.CANCELLED})
# A paid answer is the item's result whatever the item became meanwhile, as long
# as it is not finished: even after its lease ran out and it went back to the queue.
SUCCEED = _declare("succeed", set(OPEN), {S.SUCCEEDED})
# The hot path's one-statement record of an answer: only this very attempt, running.
SUCCEED_ANSWERED = _declare("succeed_answered", {S.RUNNING}, {S.SUCCEEDED})
CANCEL_BATCH = _declare(
    "cancel_batch", {S.PENDING, S.OFFLOADED, S.QUEUED, S.RUNNING}, {S.CANCELLED}
)
# An offloaded item leaves its provider job unanswered (the job failed, expired, ran
# past its cutoff, errored the row): online, or cancelled with its batch.
OFFLOAD_RETURN = _declare("offload_return", {S.OFFLOADED}, {S.PENDING, S.CANCELLED})
# The sweep's statements (sql/sweep_*.sql).
SWEEP_CANCEL_ORPHANS = _declare("sweep_cancel_orphans", {S.PENDING, S.QUEUED}, {S.CANCELLED})
SWEEP_EXPIRE = _declare("sweep_expire", {S.PENDING, S.QUEUED}, {S.EXPIRED})
# The same statement: an item its dollar budget still holds at its deadline fails.
SWEEP_EXPIRE_HELD = _declare("sweep_expire_held", {S.PENDING}, {S.FAILED})
# sql/sweep_requeue_lost.sql: a lost message (queued) or a dead worker (running).
SWEEP_LOST_QUEUED = _declare("sweep_lost_queued", {S.QUEUED}, {S.PENDING, S.CANCELLED, S.EXPIRED})
SWEEP_LOST_RUNNING = _declare(
    "sweep_lost_running", {S.RUNNING}, {S.PENDING, S.CANCELLED, S.EXPIRED, S.FAILED}
)


# The worker's hot statements: plain SQL in sql/item_*.sql, compiled once (no
# statement building and no ORM synchronisation per call). Each binds
# ``status = ANY(:sources)`` from its move's declaration; the ones that change a
# running item also check the attempt (``_owner``), so an attempt number is never
# reused for a billed call.


class Attempt(Protocol):
    """One attempt of one item, as the statements that move a running item name it."""

    @property
    def item_id(self) -> int: ...
    @property
    def attempt(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class Ticket:
    """What a released item's message carries besides its id: enough for the gate to
    decide before the item is claimed (ids and token counts, never text).

    ``attempt`` is the attempt this delivery would be (attempts so far + 1): a claim
    matches only while the item is still there, so a stale message claims nothing.
    """

    item_id: int
    batch_id: str
    tenant_id: int
    attempt: int
    prompt_tokens_est: int
    max_tokens: int
    tenant_tokens_per_min: int | None
    # A synchronous call's item: someone waits on it (it claims the next free slot).
    urgent: bool = False
    # The tenant's weight: a synchronous call's tenant gets that share of the slots.
    tenant_weight: int = 1
    # The tenant's name, for an operator finding a tenant's tasks in Flower (an
    # identifier, never request text).
    tenant_name: str | None = None
    # The deployment this item's last call failed on: the gate takes another first.
    avoid: str | None = None

    def to_message(self) -> dict[str, Any]:
        """The message's ``ticket`` keyword (JSON; the item id is the task's argument)."""
        message: dict[str, Any] = {
            "batch": self.batch_id,
            "tenant": self.tenant_id,
            "attempt": self.attempt,
            "prompt_tokens_est": self.prompt_tokens_est,
            "max_tokens": self.max_tokens,
            "tenant_tokens_per_min": self.tenant_tokens_per_min,
        }
        if self.urgent:
            message["urgent"] = True
        if self.tenant_weight != 1:
            message["weight"] = self.tenant_weight
        if self.tenant_name is not None:
            message["tenant_name"] = self.tenant_name
        if self.avoid is not None:
            message["avoid"] = self.avoid
        return message

    @classmethod
    def from_message(cls, item_id: int, data: dict[str, Any]) -> Ticket:
        """Read :meth:`to_message`'s form back; ``ValueError`` when it is not that."""
        try:
            tpm = data["tenant_tokens_per_min"]
            return cls(
                item_id=int(item_id),
                batch_id=str(data["batch"]),
                tenant_id=int(data["tenant"]),
                attempt=int(data["attempt"]),
                prompt_tokens_est=int(data["prompt_tokens_est"]),
                max_tokens=int(data["max_tokens"]),
                tenant_tokens_per_min=None if tpm is None else int(tpm),
                urgent=data.get("urgent") is True,
                tenant_weight=int(data.get("weight", 1)),
                tenant_name=None if data.get("tenant_name") is None else str(data["tenant_name"]),
                avoid=None if data.get("avoid") is None else str(data["avoid"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a ticket: {type(exc).__name__} {exc}") from None


@dataclass(frozen=True, kw_only=True)
class Claimed:
    """What a worker needs of an item it now runs (``attempt`` counts from 1).

    Times set by PostgreSQL (``deadline_at``, ``lease_expires_at``) are only ever
    compared with PostgreSQL's clock: ``now`` as read at the claim, carried
    forward with this process's monotonic clock from ``read_mono_s`` (see
    :meth:`db_now`). The worker host's wall clock plays no part.
    """

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
    tenant_tokens_per_min: int | None
    lease_expires_at: dt.datetime
    rate_limited: int  # the provider's 429s for this item so far
    # Its batch's endpoint (every item of a batch goes to it; Messages: chat).
    endpoint: str
    now: dt.datetime
    # time.monotonic() taken no later than the start of the claiming transaction
    # (whose now() is ``now``), so that :meth:`db_now` never runs behind.
    read_mono_s: float
    # Attempts that failed over to another deployment (none of them a failure attempt).
    failovers: int = 0
    # The route of this call (batchgen.domain.scheduling.routes.ItemRoute: standard or flex), the
    # flex calls refused so far, and the key of the prompt prefix it shares (if any).
    route: str = "standard"
    flex_refusals: int = 0
    prefix_key: int | None = None

    @property
    def failure_attempt(self) -> int:
        """This attempt's number among the failure attempts (failovers not counted)."""
        return self.attempt - self.failovers

    def db_now(self, mono_s: float | None = None) -> dt.datetime:
        """PostgreSQL's clock at ``mono_s`` (default: now) as seen from this process."""
        return carried_forward(
            self.now, self.read_mono_s, time.monotonic() if mono_s is None else mono_s
        )

    def lease_left_s(self) -> float:
        """Seconds until this attempt's lease runs out (negative once it has)."""
        return (self.lease_expires_at - self.db_now()).total_seconds()


def claim(
    session: Session | Connection,
    item_id: int,
    lease_s: float,
    read_mono_s: float | None = None,
    *,
    attempt: int | None = None,
) -> Claimed | None:
    """``queued → running`` with a lease; None when the item is not ours to run.

    ``read_mono_s``: ``time.monotonic()`` from before the session's transaction
    began (default: now, exact when the claim is the transaction's first statement).
    ``attempt``: the attempt the message's ticket expects (None: any).
    """
    mono_s = time.monotonic() if read_mono_s is None else read_mono_s
    params = {"item_id": item_id, "lease_s": lease_s, "attempt": attempt, **CLAIM.params()}
    row = session.execute(query("item_claim"), params).one_or_none()
    return None if row is None else _claimed(row, mono_s)


def _claimed(row: Any, read_mono_s: float) -> Claimed:
    return Claimed(
        item_id=row.id,
        batch_id=row.batch_id,
        tenant_id=row.tenant_id,
        model=row.model,
        body=row.body,
        attempt=row.attempts,
        deadline_at=row.deadline_at,
        created_at=row.created_at,
        started_at=row.started_at,
        prompt_tokens_est=row.prompt_tokens_est,
        max_tokens=row.max_tokens,
        tenant_tokens_per_min=row.tokens_per_min,
        lease_expires_at=row.lease_expires_at,
        rate_limited=row.rate_limited,
        endpoint=row.endpoint,
        now=row.now,
        read_mono_s=read_mono_s,
        failovers=row.failovers,
        route=row.route,
        flex_refusals=row.flex_refusals,
        prefix_key=row.prefix_key,
    )


def new_claim_token() -> int:
    """A random name for one claim that marks items sent (a positive 63-bit integer)."""
    return secrets.randbits(62) + 1


def claim_sent(
    session: Session | Connection,
    ticket: Ticket,
    lease_s: float,
    read_mono_s: float,
    deployment: str | None = None,
    *,
    claim_token: int,
) -> Claimed | None:
    """``queued → running``, marked sent, in one statement: the gate has already let
    the call through, to ``deployment`` (recorded on the item); ``claim_token``
    (:func:`new_claim_token`) names this claim. None when the item is not there for
    this ticket's attempt (a stale or duplicate message, a cancelled, finished or
    expired item)."""
    params: dict[str, Any] = {"item_id": ticket.item_id, "attempt": ticket.attempt}
    params.update(lease_s=lease_s, deployment=deployment, claim_token=claim_token)
    rows = db.driver_rows(session, driver_query("item_claim_sent"), {**params, **CLAIM.params()})
    return _claimed(rows[0], read_mono_s) if rows else None


def claim_sent_many(
    connection: Session | Connection,
    claims: Sequence[tuple[Ticket, str | None]],
    lease_s: float,
    read_mono_s: float,
    *,
    claim_token: int,
) -> dict[int, Claimed]:
    """:func:`claim_sent` for a pack's items in one statement: each (ticket, deployment
    the gate picked) claimed and marked sent, for its ticket's attempt, all under
    ``claim_token``. Returns the
    items claimed by id; an item left out was not there for its attempt (a stale or
    duplicate message, a cancelled, finished or expired item)."""
    if not claims:
        return {}
    claims = sorted(claims, key=lambda claim: claim[0].item_id)  # locked in id order
    params: dict[str, Any] = {
        "item_ids": [ticket.item_id for ticket, _ in claims],
        "attempts": [ticket.attempt for ticket, _ in claims],
        "deployments": [deployment for _, deployment in claims],
        "lease_s": lease_s,
        "claim_token": claim_token,
        **CLAIM.params(),
    }
    rows = db.driver_rows(connection, driver_query("item_claim_sent_many", binary=True), params)
    return {row.id: _claimed(row, read_mono_s) for row in rows}


def expire_unstarted(session: Session | Connection, item_id: int) -> str | None:
    """A pending or queued item whose deadline passed becomes expired, never sent;
    returns its batch id (None: the item was not expired)."""
    result = session.execute(
        update(Item)
        .where(Item.id == item_id, EXPIRE_UNSTARTED.where(), Item.deadline_at <= func.now())
        .values(
            status=S.EXPIRED.value,
            finished_at=func.now(),
            lease_expires_at=None,
            error_code="expired",
            last_error="deadline passed before the item could run",
        )
        .returning(Item.batch_id)
        .execution_options(synchronize_session=False)
    )
    return result.scalar_one_or_none()


def _owner(item: Attempt) -> dict[str, Any]:
    """Bind parameters naming this very attempt of the item."""
    return {"item_id": item.item_id, "attempt": item.attempt}


def finish(
    session: Session,
    item: Claimed,
    status: ItemStatus,
    code: str,
    message: str,
    *,
    rate_limited: bool = False,
) -> bool:
    """``running → failed | expired | cancelled`` for this attempt (``rate_limited``:
    it ended on a provider 429, counted on the item)."""
    if status not in FINISH.targets:
        raise ValueError(f"finish cannot end an item {status}")
    params = {**_owner(item), **FINISH.params(status), "code": code, "message": message}
    params["rate_limited"] = int(rate_limited)
    return session.execute(query("item_finish"), params).first() is not None


def requeue(
    session: Session, item: Attempt, wait_s: float, lease_s: float, *, rate_limited: bool = False
) -> bool:
    """``running → queued``: a short budget wait, an attempt handed back unsent, or a
    provider 429 (``rate_limited``: counted on the item). The attempt is not counted;
    the lease covers the wait (the task retries itself after ``wait_s``)."""
    params = {**_owner(item), **REQUEUE.params(), "lease_s": wait_s + lease_s}
    params["rate_limited"] = int(rate_limited)
    return session.execute(query("item_requeue"), params).first() is not None


def requeue_lost_claim(session: Session, item: Attempt, claim_token: int, lease_s: float) -> bool:
    """``running → queued``: the claim ``claim_token``, whose reply was lost and that may
    have committed (even after its error was seen); a later claim of the same attempt
    number (another worker's, after the sweep took the item back) is not this one and
    stays."""
    params = {**_owner(item), **REQUEUE.params(), "lease_s": lease_s}
    params["claim_token"] = claim_token
    return session.execute(query("item_requeue_lost_claim"), params).first() is not None


def failover(
    session: Session,
    item: Attempt,
    lease_s: float,
    code: str,
    message: str,
    *,
    rate_limited: bool = False,
) -> bool:
    """``running → queued``, on to another deployment: the call failed on its own (a 429,
    5xx, time-out or refused connection). The attempt number is kept (a billed call's
    ledger row is under it) and counted as a failover, not as a failure attempt; the
    lease covers the wait until the next delivery."""
    params = {**_owner(item), **FAILOVER.params(), "lease_s": lease_s}
    params.update(rate_limited=int(rate_limited), code=code, message=message)
    return session.execute(query("item_failover"), params).first() is not None


def reroute(
    session: Session,
    item: Attempt,
    *,
    route: str,
    wait_s: float,
    lease_s: float | None,
    code: str,
    message: str,
) -> bool:
    """A flex call refused as busy: the attempt is handed back (the provider billed
    nothing), the refusal counted, and the item's next call takes ``route``: ``running
    → queued`` (``lease_s`` set: the task retries itself after ``wait_s``) or ``→
    pending`` not before ``wait_s`` from now (``lease_s`` None: the dispatcher releases
    it)."""
    target = S.PENDING if lease_s is None else S.QUEUED
    params = {**_owner(item), **REROUTE.params(target), "route": route, "wait_s": wait_s}
    params.update(lease_s=(lease_s or 0.0) + wait_s, code=code, message=message)
    params["defer"] = target is S.PENDING
    return session.execute(query("item_reroute"), params).first() is not None


def hold_queued(
    connection: Session | Connection, held: Sequence[tuple[int, int]], lease_s: float
) -> int:
    """``queued`` items (id, the attempt their message would make) that a pack keeps
    waiting, or hands back to the broker: their queued leases last ``lease_s`` from now
    (never shortened), so the sweep does not hand them back meanwhile. Returns how many
    were still queued for that attempt."""
    if not held:
        return 0
    pairs = [(item_id, attempt - 1) for item_id, attempt in held]
    return _extend_leases(connection, S.QUEUED, pairs, lease_s, never_shorten=True)


def _extend_leases(
    connection: Session | Connection,
    status: S,
    held: Sequence[tuple[int, int]],
    lease_s: float,
    *,
    never_shorten: bool,
) -> int:
    """The leases of the ``(item_id, attempts)`` pairs' items still in ``status`` on
    that many attempts (:file:`sql/item_extend_leases.sql`); returns how many."""
    pairs = sorted(held)  # the order of the locks
    params = {
        "item_ids": [item_id for item_id, _ in pairs],
        "attempts": [attempts for _, attempts in pairs],
        "status": status.value,
        "lease_s": lease_s,
        "never_shorten": never_shorten,
    }
    return len(connection.execute(query("item_extend_leases"), params).all())


def defer(
    session: Session, item: Claimed, wait_s: float, reason: str, *, rate_limited: bool = False
) -> bool:
    """``running → pending``: a long budget wait or provider 429 (``rate_limited``:
    counted on the item), released again after ``wait_s``; the attempt is not counted."""
    params = {**_owner(item), **DEFER.params(), "wait_s": wait_s, "reason": reason}
    params.update(
        rate_limited=int(rate_limited), code="rate_limited" if rate_limited else "budget_wait"
    )
    return session.execute(query("item_defer"), params).first() is not None


def retry_later(session: Session, item: Claimed, wait_s: float, code: str, message: str) -> bool:
    """``running → pending``, not before ``now + wait_s``: the retry goes through the
    dispatcher. False when the batch was cancelled meanwhile (it must not run again)."""
    params = {**_owner(item), **RETRY_LATER.params(), "wait_s": wait_s}
    params.update(code=code, message=message)
    return session.execute(query("item_retry_later"), params).first() is not None


@dataclass(frozen=True)
class LockedItem:
    """An item row locked for recording a call's outcome (``FOR UPDATE``)."""

    id: int
    batch_id: str
    tenant_id: int
    model: str
    status: ItemStatus
    attempts: int
    sent_at: dt.datetime | None
    prompt_tokens_est: int
    deployment: str | None = None  # the deployment of the current attempt's call
    max_tokens: int = 0  # the most output a call of it may be billed for


def lock(session: Session, item_id: int, *, for_update: bool = True) -> LockedItem | None:
    """Read an item (locked, by default): a duplicate run of the same item waits here
    and then sees the first one's verdict."""
    statement = query("item_lock") if for_update else query("item_read")
    row = session.execute(statement, {"item_id": item_id}).one_or_none()
    if row is None:
        return None
    return LockedItem(
        id=row.id,
        batch_id=row.batch_id,
        tenant_id=row.tenant_id,
        model=row.model,
        status=ItemStatus(row.status),
        attempts=row.attempts,
        sent_at=row.sent_at,
        prompt_tokens_est=row.prompt_tokens_est,
        deployment=row.deployment,
        max_tokens=row.max_tokens,
    )


def succeed(session: Session, item_id: int) -> bool:
    """``open → succeeded``: a paid answer became the item's result."""
    params = {"item_id": item_id, **SUCCEED.params()}
    return session.execute(query("item_succeed"), params).first() is not None


@dataclass(frozen=True)
class Answered:
    """What :func:`succeed_answered` found, as of its statement's snapshot."""

    recorded: bool  # the answer is the item's result, ledgered once
    waiting: bool  # items of the batch still pending or queued
    running: bool  # other items of the batch running (ours not counted)
    closed: bool = False  # the batch finished with it (a synchronous call's)


def _answer_json(response: Any) -> Jsonb:
    """An answer as a JSONB parameter, written by :mod:`batchgen.json_codec`."""
    return Jsonb(response, dumps=json_codec.dumps)


def succeed_answered(connection: Connection, row: dict[str, Any]) -> Answered:
    """``running → succeeded`` with the ledger row, the daily totals and the result, in
    one statement; ``recorded`` is False (and nothing written) unless this very attempt
    (``row["item_id"]``, ``row["attempt"]``) is running and neither answered nor
    ledgered yet. ``row`` holds the ledger's and the result's columns
    (:func:`batchgen.store.ledger.record_answer` builds it)."""
    params = {
        **row,
        "response": _answer_json(row["response"]),
        **SUCCEED_ANSWERED.params(),
    }
    (result,) = db.driver_rows(
        connection, driver_query("item_succeed_answered", binary=True), params
    )
    return Answered(
        recorded=result.recorded,
        waiting=result.waiting,
        running=result.running,
        closed=result.closed,
    )


# The columns of an answer, in item_succeed_answered_many.sql's order (one array each).
ANSWER_COLUMNS = (
    "item_id",
    "attempt",
    "tenant_id",
    "batch_id",
    "model",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
    "cost_usd",
    "deployment",
    "tier",
    "response",
    "provider_request_id",
    "upstream_latency_ms",
    "queue_wait_ms",
)


def succeed_answered_many(
    connection: Connection, rows: Sequence[Mapping[str, Any]], shard: int
) -> dict[int, Answered]:
    """:func:`succeed_answered` for a group of online answers, in one statement (a group
    commit): each row (:data:`ANSWER_COLUMNS`) recorded only if its attempt still runs
    the item and is neither answered nor ledgered yet; the tenants' daily totals in
    ``shard``. Returns, by item id, whether it was recorded and whether its batch had
    items waiting (``running`` is not read here: False)."""
    if not rows:
        return {}
    rows = sorted(rows, key=lambda row: int(row["item_id"]))  # locked in id order
    params: dict[str, Any] = {
        column: [row[column] for row in rows] for column in ANSWER_COLUMNS if column != "response"
    }
    params["response"] = [_answer_json(row["response"]) for row in rows]
    params.update(shard=shard, **SUCCEED_ANSWERED.params())
    found = db.driver_rows(
        connection, driver_query("item_succeed_answered_many", binary=True), params
    )
    return {
        row.item_id: Answered(recorded=row.recorded, waiting=row.waiting, running=False)
        for row in found
    }


def cancel_unsent(session: Session, batch_id: str, now: dt.datetime) -> int:
    """End every item of the batch whose provider request has not been sent
    (pending, queued, or running unsent: claimed for a wait); returns how many."""
    result = session.execute(
        update(Item)
        .where(
            Item.batch_id == batch_id,
            Item.status.in_(values(CANCEL_BATCH.sources - {S.RUNNING, S.OFFLOADED}))
            # running but the request not yet sent: see claim_sent
            | ((Item.status == S.RUNNING.value) & Item.sent_at.is_(None))
            # offloaded but in no provider job yet (a job's items end with the job)
            | ((Item.status == S.OFFLOADED.value) & Item.job_id.is_(None)),
        )
        .values(
            status=S.CANCELLED.value,
            finished_at=now,
            lease_expires_at=None,
            error_code="cancelled",
            last_error="batch cancelled",
        )
        .returning(Item.id)
        .execution_options(synchronize_session=False)
    )
    return len(result.all())


def clear_prefix_keys(session: Session, batch_id: str, keys: Sequence[int]) -> int:
    """Forget the prefix keys that only one item of the batch has (nothing shares its
    prefix): such an item is neither grouped nor marked for the provider's cache."""
    if not keys:
        return 0
    result = session.execute(
        update(Item)
        .where(Item.batch_id == batch_id, Item.prefix_key.in_(list(keys)))
        .values(prefix_key=None)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


# --- offloaded items (batchgen.worker.offload_jobs) ----------------------------------


@dataclass(frozen=True)
class Waiting:
    """An offloaded item not yet in a provider job, as the planner sees it."""

    item_id: int
    batch_id: str
    body: dict[str, Any]
    prompt_tokens_est: int
    max_tokens: int
    deadline_at: dt.datetime
    offload: str  # its batch's mode
    endpoint: str  # its batch's endpoint
    prefix_key: int | None = None  # the prompt prefix it shares with others (if any)


def offload_waiting(session: Session, model: str, limit: int) -> list[Waiting]:
    """The model's offloaded items in no job yet, by batch then id (oldest first)."""
    rows = session.execute(
        text(
            """
            SELECT i.id, i.batch_id, i.body, i.prompt_tokens_est, i.max_tokens,
                   i.deadline_at, b.offload, b.endpoint, i.prefix_key
            FROM items AS i JOIN batches AS b ON b.id = i.batch_id
            WHERE i.model = :model AND i.status = 'offloaded' AND i.job_id IS NULL
            ORDER BY i.batch_id, i.id
            LIMIT :limit
            """
        ),
        {"model": model, "limit": limit},
    )
    return [
        Waiting(
            item_id=r.id,
            batch_id=r.batch_id,
            body=r.body,
            prompt_tokens_est=r.prompt_tokens_est,
            max_tokens=r.max_tokens,
            deadline_at=r.deadline_at,
            offload=r.offload,
            endpoint=r.endpoint,
            prefix_key=r.prefix_key,
        )
        for r in rows
    ]


def offload_waiting_models(session: Session) -> set[str]:
    """The models with offloaded items waiting for a provider job."""
    return set(
        session.scalars(
            select(Item.model)
            .where(Item.status == S.OFFLOADED.value, Item.job_id.is_(None))
            .distinct()
        )
    )


def assign_job(session: Session, job_id: int, item_ids: list[int]) -> dict[int, int]:
    """Put waiting offloaded items into the job ``job_id``, each its next attempt (the
    attempt its row will be ledgered as); returns ``{item id: attempt}`` of those
    still waiting (an item cancelled meanwhile is not taken)."""
    rows = session.execute(
        update(Item)
        .where(Item.id.in_(item_ids), Item.status == S.OFFLOADED.value, Item.job_id.is_(None))
        .values(job_id=job_id, attempts=Item.attempts + 1)
        .returning(Item.id, Item.attempts)
        .execution_options(synchronize_session=False)
    )
    return {r.id: r.attempts for r in rows}


def unassign_job(session: Session, job_id: int) -> int:
    """The job's offloaded items wait for another job (its create never reached the
    provider, or the provider had no room for it)."""
    result = session.execute(
        update(Item)
        .where(Item.job_id == job_id, Item.status == S.OFFLOADED.value)
        .values(job_id=None)
        .returning(Item.id)
        .execution_options(synchronize_session=False)
    )
    return len(result.all())


_OFFLOAD_RETURN = text(
    """
    UPDATE items
    SET status = CASE WHEN b.cancel_requested_at IS NULL THEN 'pending' ELSE 'cancelled' END,
        not_before = NULL,
        finished_at = CASE WHEN b.cancel_requested_at IS NULL THEN NULL ELSE now() END,
        error_code = CASE WHEN b.cancel_requested_at IS NULL THEN :code ELSE 'cancelled' END,
        last_error = CASE WHEN b.cancel_requested_at IS NULL THEN :message
                          ELSE 'batch cancelled' END
    FROM batches AS b
    WHERE b.id = items.batch_id
      AND items.status = ANY(:sources)
      AND (CAST(:job_id AS bigint) IS NULL OR items.job_id = :job_id)
      AND (CAST(:item_ids AS bigint[]) IS NULL OR items.id = ANY(:item_ids))
    RETURNING items.id, items.batch_id, items.status
    """
)


def return_online(
    session: Session,
    code: str,
    message: str,
    *,
    job_id: int | None = None,
    item_ids: list[int] | None = None,
) -> list[tuple[int, str, ItemStatus]]:
    """``offloaded → pending`` (back online, its code saying why) for the job's items
    still offloaded, or the given ones; ``→ cancelled`` for those of a cancelled
    batch. Returns ``(item id, batch id, new status)`` of each. Their route stays
    ``batch``: called online, such an item calls flex where its model offers it and
    the deadline leaves room, else standard
    (:func:`batchgen.domain.scheduling.routes.call_route`)."""
    if job_id is None and item_ids is None:
        raise ValueError("return_online needs a job or items")
    params = {
        "sources": values(OFFLOAD_RETURN.sources),
        "code": code,
        "message": message,
        "job_id": job_id,
        "item_ids": item_ids,
    }
    rows = session.execute(_OFFLOAD_RETURN, params)
    return [(r.id, r.batch_id, ItemStatus(r.status)) for r in rows]


# --- the dispatcher's release -------------------------------------------------


def lock_model(session: Session, model: str) -> bool:
    """The model's dispatch lock for this transaction (False: another dispatcher holds
    it): it makes the count of the window and the release one critical section."""
    return bool(
        session.scalar(
            text("SELECT pg_try_advisory_xact_lock(:ns, hashtext(:model))"),
            {"ns": ADVISORY_NAMESPACE, "model": model},
        )
    )


def in_flight(session: Session, model: str) -> int:
    """The model's items queued or running (its dispatch window in use). Synchronous
    calls are left out: they skip the window, and a tenant's flood of them must not
    close it to the other tenants' batches (the gate shares the slots between both,
    :mod:`batchgen.domain.scheduling.call_shares`)."""
    return (
        session.scalar(
            select(func.count())
            .select_from(Item)
            .where(
                Item.model == model,
                Item.status.in_(values(IN_FLIGHT)),
                Item.priority_rank != CALL_RANK,
            )
        )
        or 0
    )


@dataclass(frozen=True)
class Pick:
    """A released item: its ticket, and its place in its tenant's order."""

    ticket: Ticket
    order: tuple[int, int, int]  # (priority rank, dispatch key, id)
    # The key of the long prompt prefix it shares with others (None: none).
    prefix_key: int | None = None

    def cache_group(self) -> tuple[int, int] | None:
        """The picks to release together (batchgen.domain.scheduling.round_robin.order_picks): those
        of one priority sharing a cached prompt prefix."""
        return None if self.prefix_key is None else (self.order[0], self.prefix_key)


def release_picks(
    session: Session, model: str, takes: dict[int, int], queued_lease_s: float
) -> list[Pick]:
    """``pending → queued`` for up to ``takes[tenant]`` ready items of each tenant on
    ``model``, each tenant's first in its order (:file:`sql/item_release.sql`; rows held
    by another transaction are skipped: ``FOR UPDATE SKIP LOCKED``); each tenant's picks
    in that order. The caller holds the model's lock (:func:`lock_model`)."""
    if not takes:
        return []
    params = {
        "model": model,
        "tenant_ids": list(takes),
        "takes": list(takes.values()),
        "lease_s": queued_lease_s,
        **RELEASE.params(),
    }
    rows = session.execute(query("item_release"), params).all()
    picks = [Pick(_ticket(r), (r.priority_rank, r.dispatch_key, r.id), r.prefix_key) for r in rows]
    return sorted(picks, key=lambda p: p.order)


def unrelease(session: Session, item_ids: list[int]) -> int:
    """``queued → pending`` for items released in the caller's transaction whose
    dollar budget refused them: as if they had not been picked (nothing was sent),
    marked held by it (``error_code`` ``budget_exhausted``: still held at its deadline,
    the item ends failed with that code, :func:`sweep_expire`)."""
    if not item_ids:
        return 0
    result = session.execute(
        update(Item)
        .where(Item.id.in_(item_ids), UNRELEASE.where())
        .values(
            status=S.PENDING.value,
            queued_at=None,
            lease_expires_at=None,
            error_code=BUDGET_HELD,
            last_error="held: its dollar budget cannot cover it this period",
        )
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


# Deferred items made ready per dispatch round and model, at least.
READY_DUE_PER_ROUND = 1000


def models_with_work(session: Session, models: Sequence[str]) -> set[str]:
    """The models among ``models`` with items for the dispatcher: pending and ready, or
    deferred past their time. A model with neither has nothing to release (its round
    would lock it, count its window and read an empty ring)."""
    if not models:
        return set()
    return set(session.scalars(query("models_with_work"), {"models": list(models)}))


def ready_due(session: Session, model: str, limit: int) -> int:
    """Deferred pending items whose ``not_before`` has passed become ready for the
    dispatcher (up to ``limit``, the earliest first); returns how many."""
    return len(session.execute(query("item_ready_due"), {"model": model, "limit": limit}).all())


def release_call(session: Session, batch_id: str, queued_lease_s: float) -> Ticket | None:
    """``pending → queued`` for the one item of a synchronous call, now: a call waits
    for no window (someone is waiting on it; the slot and the budget still apply)."""
    row = session.execute(
        update(Item)
        .where(Item.batch_id == batch_id, RELEASE.where(), Item.tenant_id == Tenant.id)
        .values(
            status=S.QUEUED.value,
            queued_at=func.now(),
            lease_expires_at=func.now() + dt.timedelta(seconds=queued_lease_s),
        )
        .returning(*_TICKET_COLUMNS)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    return None if row is None else _ticket(row)


_TICKET_COLUMNS = (
    Item.id,
    Item.batch_id,
    Item.tenant_id,
    Item.attempts,
    Item.prompt_tokens_est,
    Item.max_tokens,
    Tenant.tokens_per_min,
    Item.priority_rank,
    Tenant.name,
    Tenant.weight,
)


def ticket_from_row(row: Any) -> Ticket:
    """The ticket of a row of :data:`_TICKET_COLUMNS` (a statement of its own that
    returns them, such as ``sql/call_store.sql``)."""
    return _ticket(row)


def _ticket(row: Any) -> Ticket:
    return Ticket(
        item_id=row.id,
        batch_id=row.batch_id,
        tenant_id=row.tenant_id,
        attempt=row.attempts + 1,
        prompt_tokens_est=row.prompt_tokens_est,
        max_tokens=row.max_tokens,
        tenant_tokens_per_min=row.tokens_per_min,
        urgent=row.priority_rank == CALL_RANK,
        tenant_weight=row.weight,
        tenant_name=row.name,
    )


def error_code_of(session: Session | Connection, item_id: int) -> str | None:
    """The error code an item ended with (a code, never the provider's text)."""
    return session.scalar(select(Item.error_code).where(Item.id == item_id))


def ticket_of(session: Session | Connection, item_id: int) -> tuple[str, Ticket] | None:
    """The model and the ticket of a queued item (for a message that carries none)."""
    row = session.execute(
        select(Item.model, *_TICKET_COLUMNS).where(
            Item.id == item_id, Item.tenant_id == Tenant.id, Item.status == S.QUEUED.value
        )
    ).one_or_none()
    return None if row is None else (row.model, _ticket(row))


# --- the sweep's moves ----------------------------------------------------------


@dataclass(frozen=True)
class LostAttempt:
    """An item whose lease ran out, and where the sweep moved it."""

    item_id: int
    batch_id: str
    status: ItemStatus
    attempts: int
    was_sent: bool  # the lost attempt's request had been sent: it may be billed
    lease: str = "running"  # which lease ran out: 'queued' or 'running'
    model: str = ""
    claim_token: int | None = None  # the claim that marked it sent (None: no such claim)


def sweep_cancel_orphans(session: Session) -> int:
    """Pending or queued items of a cancelled batch end cancelled."""
    return len(session.execute(query("sweep_cancel_orphans")).all())


# What an item a dollar budget holds back carries, and ends with at its deadline.
BUDGET_HELD = "budget_exhausted"


def sweep_expire(session: Session) -> int:
    """Pending or queued items whose deadline passed end expired (never sent); those
    still held by their dollar budget (:func:`unrelease`) end failed, ``budget_exhausted``."""
    return len(session.execute(query("sweep_expire")).all())


def sweep_lost(
    session: Session,
    max_attempts: int,
    attempt_caps: dict[str, int],
    alive: Collection[int] = (),
    callers_gone: Mapping[int, int] | None = None,
) -> list[LostAttempt]:
    """Queued and running items whose lease ran out: back to pending, or ended
    (cancelled, expired, or failed once a running one used its attempt cap). Items
    in ``alive`` (their owner's heartbeat is live) are left alone; synchronous calls
    in ``callers_gone`` (nobody waits for them; item id -> the attempt seen so) end
    cancelled, unless another attempt has begun since."""
    gone = {str(item_id): attempt for item_id, attempt in (callers_gone or {}).items()}
    params = {
        "max_attempts": max_attempts,
        "attempt_caps": json.dumps(attempt_caps),
        "alive": sorted(alive),
        "callers_gone": json.dumps(gone),
    }
    rows = session.execute(query("sweep_requeue_lost"), params)
    return [
        LostAttempt(
            item_id=r.id,
            batch_id=r.batch_id,
            status=ItemStatus(r.status),
            attempts=r.attempts,
            was_sent=r.was_sent,
            lease=r.prev_status,
            model=r.model,
            claim_token=r.claim_token,
        )
        for r in rows
    ]


# --- running leases: a worker's heartbeat, the sweep's look ----------------------


def renew_leases(
    connection: Session | Connection, held: Sequence[tuple[int, int]], lease_s: float
) -> int:
    """Extend to ``lease_s`` from now the lease of each ``(item_id, attempt)`` still
    running on that attempt (one statement; app/worker/heartbeat.py); returns how many."""
    if not held:
        return 0
    return _extend_leases(connection, S.RUNNING, held, lease_s, never_shorten=False)


@dataclass(frozen=True)
class OpenCall:
    """A synchronous call's item, queued or running, for the sweep to ask after its
    caller: its current attempt, and whether its lease has run out."""

    item_id: int
    attempt: int
    ran_out: bool


def calls_to_check(session: Session, caller_lease_s: float) -> list[OpenCall]:
    """Synchronous calls' items (queued or running) whose lease has run out, or that were
    stored over ``caller_lease_s`` ago (their caller has renewed its presence since, if
    it still waits)."""
    stored_before = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, caller_lease_s)
    ran_out = Item.lease_expires_at < func.now()
    rows = session.execute(
        select(Item.id, Item.attempts, ran_out.label("ran_out")).where(
            Item.priority_rank == CALL_RANK,
            Item.status.in_([S.QUEUED.value, S.RUNNING.value]),
            or_(ran_out, Item.created_at < stored_before),
        )
    )
    return [OpenCall(r.id, r.attempts, bool(r.ran_out)) for r in rows]


def leases_ran_out(session: Session) -> list[tuple[int, int]]:
    """``(item_id, attempt)`` of the running items whose lease has run out."""
    rows = session.execute(
        select(Item.id, Item.attempts).where(
            Item.status == S.RUNNING.value, Item.lease_expires_at < func.now()
        )
    )
    return [(r.id, r.attempts) for r in rows]
