"""Synchronous calls in PostgreSQL: stored as one-item batches of priority ``call``
and released at once, and their end heard when it commits.

A call's item skips the dispatcher's window (someone is waiting on it; the
concurrency slot and the budget still hold it back), and the backlog bound of
bulk work does not apply to it: the fail-fast rule does
(:func:`batchgen.domain.formats.call_rules.refuse_after_s`), against the calls already ahead.

Its end is heard through ``LISTEN batchgen_call_done``: migration 0006's trigger
sends the item id when a call's item reaches a terminal status, at commit, when
the result is readable. One listening connection per process serves every
waiting request (:class:`CallWaiter`); a waiter also reads the item once per
``poll_s``, so a lost connection only slows the answer down. That connection
goes straight to PostgreSQL (``BATCHGEN_DATABASE_DIRECT_URL``, else
``DATABASE_URL``): behind a transaction pooler a ``LISTEN`` would stay on a server
connection others then use, and hear nothing on its own.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg
from sqlalchemy import Connection, func, select, update
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.formats.call_rules import key_replays
from batchgen.domain.lifecycle.status import CALL_RANK, OPEN, TERMINAL, ItemStatus, Priority, values
from batchgen.domain.submission import SubmitOptions
from batchgen.registry import Registry
from batchgen.store import batches, db, items
from batchgen.store.schema import Batch, Item, Result, Tenant
from batchgen.store.sqlfiles import driver_query

log = logging.getLogger(__name__)
CHANNEL = "batchgen_call_done"
RECONNECT_S = 1.0
# How often the listener looks up from its notifications to see whether it was closed.
CLOSE_CHECK_S = 1.0


@dataclass(frozen=True)
class StoredCall:
    batch_id: str
    item_id: int
    model: str
    queue_ticket: items.Ticket | None
    # The call's Idempotency-Key named an earlier call of the same request: its answer
    # is this one's, and nothing was stored or released for it.
    replayed: bool = False


def calls_ahead_tokens(session: Session, model: str) -> int:
    """The estimated tokens of the calls still open on ``model`` (ahead of a new one)."""
    query = select(func.coalesce(func.sum(Item.prompt_tokens_est + Item.max_tokens), 0)).where(
        Item.model == model, Item.priority_rank == CALL_RANK, Item.status.in_(values(OPEN))
    )
    return int(session.scalar(query) or 0)


def open_calls(session: Session, model: str, tenant_id: int) -> int:
    """The tenant's calls still open on ``model`` (waiting for a slot, or running)."""
    query = select(func.count()).where(
        Item.model == model,
        Item.tenant_id == tenant_id,
        Item.priority_rank == CALL_RANK,
        Item.status.in_(values(OPEN)),
    )
    return int(session.scalar(query) or 0)


class CallLoad(NamedTuple):
    """What the fail-fast rule reads of PostgreSQL (:func:`call_load`)."""

    ahead_tokens: int
    own_open: int
    # Whether the tenant has any dollar budget (its own or a key's).
    has_budgets: bool


def call_load(
    connection: Connection, model: str, tenant_id: int, read_budget: bool = True
) -> CallLoad:
    """:func:`calls_ahead_tokens` and the tenant's :func:`open_calls` on ``model``, and
    (``read_budget``) whether the tenant has a dollar budget, in one statement
    (``sql/call_load.sql``); without ``read_budget``, ``has_budgets`` is False."""
    params = {
        "model": model,
        "tenant_id": tenant_id,
        "call_rank": CALL_RANK,
        "read_budget": read_budget,
    }
    (row,) = db.driver_rows(connection, driver_query("call_load"), params)
    return CallLoad(int(row.ahead_tokens), int(row.own_open), bool(row.has_budgets))


def _spent_call(session: Session, tenant_id: int, key: str, lock: bool = False) -> Any:
    """The batch id of the call holding the tenant's ``key`` if it ended in a way a
    retry must not get again (:func:`batchgen.domain.formats.call_rules.key_replays`), else None;
    ``lock``: its batch row locked."""
    query = (
        select(Batch.id, Item.status, Item.error_code)
        .join(Item, Item.batch_id == Batch.id)
        .where(
            Batch.tenant_id == tenant_id,
            Batch.idempotency_key == key,
            Batch.priority == Priority.CALL.value,
        )
    )
    held = session.execute(query.with_for_update(of=Batch) if lock else query).first()
    if held is None or key_replays(ItemStatus(held.status), held.error_code):
        return None
    return held.id


def key_used(session: Session, tenant_id: int, key: str) -> bool:
    """Whether the tenant stored a request under this Idempotency-Key that a request
    under it is answered from (replayed, or refused as another request's): a call the
    key is freed from (:func:`_free_a_spent_key`) does not count."""
    query = select(Batch.id).where(Batch.tenant_id == tenant_id, Batch.idempotency_key == key)
    return session.scalar(query) is not None and _spent_call(session, tenant_id, key) is None


def _free_a_spent_key(session: Session, tenant_id: int, key: str) -> None:
    """The call holding the tenant's ``key``, if it ended in a way a retry must not get
    again, gives the key up: the request under it is stored as a new call. Its row is
    locked, so of two such retries one frees the key and the other finds the new call."""
    spent = _spent_call(session, tenant_id, key, lock=True)
    if spent is not None:
        session.execute(update(Batch).where(Batch.id == spent).values(idempotency_key=None))


def store_call(
    session: Session,
    tenant: Tenant,
    line: dict[str, Any],
    *,
    deadline_s: float,
    endpoint: str,
    registry: Registry,
    settings: Settings,
    idempotency_key: str | None = None,
    key_id: int | None = None,
) -> StoredCall:
    """Validate and store a call's line as a batch of one, and release it (one
    transaction, the caller's). With an ``idempotency_key`` the tenant used for the
    same request, the earlier call is returned (``replayed``) and nothing is stored;
    for another request, :class:`~batchgen.errors.IdempotencyKeyReused` (422)."""
    options = SubmitOptions(
        completion_window=deadline_s,
        priority=Priority.CALL,
        endpoint=endpoint,
        idempotency_key=idempotency_key,
        key_id=key_id,
    )
    if idempotency_key:
        _free_a_spent_key(session, tenant.id, idempotency_key)
    raw = json.dumps(line, ensure_ascii=False).encode("utf-8")
    batch, created = batches.store_batch(session, tenant, iter([raw]), options, registry, settings)
    # A replayed call is not released again: its one run (done or under way) answers it.
    ticket = (
        items.release_call(session, batch.id, settings.worker.queued_lease_s) if created else None
    )
    item_id, model = session.execute(
        select(Item.id, Item.model).where(Item.batch_id == batch.id)
    ).one()
    return StoredCall(batch.id, item_id, model, ticket, replayed=not created)


def store_plain_call(
    connection: Connection,
    tenant: Tenant,
    line: dict[str, Any],
    *,
    deadline_s: float,
    endpoint: str,
    registry: Registry,
    settings: Settings,
    key_id: int | None = None,
) -> StoredCall | None:
    """:func:`store_call` for a call with no Idempotency-Key in one statement
    (autocommit: ``sql/call_store.sql``), validated as :func:`store_call` validates
    it; None, with nothing stored, when it needs :func:`store_call` itself
    (:func:`batchgen.store.batches.call_rows` says when)."""
    options = SubmitOptions(
        completion_window=deadline_s, priority=Priority.CALL, endpoint=endpoint, key_id=key_id
    )
    raw = json.dumps(line, ensure_ascii=False).encode("utf-8")
    rows = batches.call_rows(tenant, raw, options, registry, settings)
    if rows is None:
        return None
    item = rows.item
    params = {
        **rows.batch,
        **{k: item[k] for k in ITEM_COLUMNS},
        "queued": ItemStatus.QUEUED.value,
        "item_route": item["route"],
        "item_window_s": rows.item_window_s,
        "queued_lease_s": settings.worker.queued_lease_s,
        "tokens_est": item["prompt_tokens_est"] + item["max_tokens"],
    }
    (row,) = db.driver_rows(connection, driver_query("call_store"), params)
    return StoredCall(rows.batch["id"], row.id, item["model"], items.ticket_from_row(row))


# The item's columns that sql/call_store.sql takes as they are.
ITEM_COLUMNS = (
    "line_no",
    "custom_id",
    "model",
    "priority_rank",
    "body",
    "prompt_tokens_est",
    "max_tokens",
)


def backoff_left_s(session: Session, item_id: int) -> float | None:
    """Seconds until a pending call item may run again (0: now); None when it is not
    pending (a dispatcher released it, or it ended)."""
    row = session.execute(
        select(
            Item.status, func.greatest(0.0, func.extract("epoch", Item.not_before - func.now()))
        ).where(Item.id == item_id)
    ).one_or_none()
    if row is None or row[0] != ItemStatus.PENDING.value:
        return None
    return float(row[1] or 0.0)


def release_again(session: Session, item_id: int, queued_lease_s: float) -> items.Ticket | None:
    """Release a call item that went back to pending (a retry) at once, here."""
    batch_id = session.scalar(select(Item.batch_id).where(Item.id == item_id))
    return items.release_call(session, batch_id, queued_lease_s) if batch_id else None


@dataclass(frozen=True)
class CallOutcome:
    status: ItemStatus
    response: dict[str, Any] | None
    error_code: str | None
    error_message: str | None


def outcome(session: Session, item_id: int) -> CallOutcome | None:
    """The call's end, once its item is terminal (None while it is open)."""
    row = session.execute(
        select(Item.status, Item.error_code, Item.last_error, Result.response)
        .outerjoin(Result, Result.item_id == Item.id)
        .where(Item.id == item_id)
    ).one_or_none()
    if row is None or ItemStatus(row.status) not in TERMINAL:
        return None
    return CallOutcome(ItemStatus(row.status), row.response, row.error_code, row.last_error)


def batch_of(session: Session, item_id: int) -> Batch | None:
    return session.scalar(
        select(Batch).join(Item, Item.batch_id == Batch.id).where(Item.id == item_id)
    )


def listener_name(pid: int) -> str:
    """The ``application_name`` of process ``pid``'s listening connection."""
    return f"batchgen call listener {pid}"


class CallWaiter:
    """The process's one ``LISTEN`` connection, and the requests waiting on it."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        # Several per item: an Idempotency-Key's replays wait on the call beside its caller.
        self._events: dict[int, list[threading.Event]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._listening = threading.Event()
        self._closed = threading.Event()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._listen, name="batchgen-call-listener", daemon=True
                )
                self._thread.start()

    def _listen(self) -> None:
        while not self._closed.is_set():
            try:
                with psycopg.connect(
                    self.dsn, autocommit=True, application_name=listener_name(os.getpid())
                ) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._listening.set()
                    while not self._closed.is_set():
                        for note in conn.notifies(timeout=CLOSE_CHECK_S):
                            self._wake(note.payload)
            except Exception as exc:  # the connection went away: waiters poll meanwhile
                self._listening.clear()
                if self._closed.is_set():
                    return
                log.warning("call listener: %s; listening again", type(exc).__name__)
                self._closed.wait(RECONNECT_S)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening (its connection closed) before the database goes away."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _wake(self, payload: str) -> None:
        try:
            item_id = int(payload)
        except ValueError:
            return
        with self._lock:
            events = list(self._events.get(item_id, ()))
        for event in events:
            event.set()

    def register(
        self, item_id: int, ready_timeout_s: float = 2.0, event: threading.Event | None = None
    ) -> threading.Event:
        """Start listening for ``item_id`` (before its end can commit); the event set
        at its end is ``event`` when given."""
        self._start()
        event = event if event is not None else threading.Event()
        with self._lock:
            self._events.setdefault(item_id, []).append(event)
        self._listening.wait(ready_timeout_s)
        return event

    def forget(self, item_id: int, event: threading.Event | None = None) -> None:
        """Stop waking ``event`` for ``item_id`` (None: every waiter of it)."""
        with self._lock:
            events = self._events.pop(item_id, [])
            kept = [e for e in events if event is not None and e is not event]
            if kept:
                self._events[item_id] = kept

    @staticmethod
    def wait_ticks(
        event: threading.Event, deadline_mono_s: float, poll_s: float, *, first: bool = False
    ) -> Iterator[float]:
        """Yield after each wake-up or ``poll_s`` (and at once, with ``first``), until
        ``deadline_mono_s``; the value is the time left."""
        if first:
            yield deadline_mono_s - time.monotonic()
        while True:
            left = deadline_mono_s - time.monotonic()
            if left <= 0:
                return
            event.wait(min(poll_s, left))
            event.clear()
            yield deadline_mono_s - time.monotonic()
