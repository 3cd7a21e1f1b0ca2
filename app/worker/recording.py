"""Recording a delivery's outcome in PostgreSQL, whatever the database does meanwhile.

A provider call that was made is paid, so what follows it is retried through a
database outage for as long as the item's lease lasts. The transaction that
ends an item also closes its batch when nothing of it is open; an item at a
batch's tail (only items running elsewhere are open) checks again after its
commit (:func:`batchgen.store.batches.close_if_done`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.store import batches, db, items
from batchgen.store.batches import Progress
from batchgen.store.db import session_scope
from batchgen.store.items import Attempt, Claimed
from batchgen.telemetry import tracing

log = logging.getLogger(__name__)
T = TypeVar("T")


class Owned(Attempt, Protocol):
    """An attempt that is ours for a while (a :class:`Claimed` item is one)."""

    def lease_left_s(self) -> float: ...


@dataclass(frozen=True)
class LostClaim:
    """A claim whose reply was lost: the item may be ours (if the claim committed, now
    or later) for at most its lease. ``claim_token``: the claim's own name
    (:func:`batchgen.store.items.new_claim_token`)."""

    item_id: int
    attempt: int
    until_mono_s: float
    claim_token: int

    def lease_left_s(self) -> float:
        return self.until_mono_s - time.monotonic()


def give_back(item: Owned, settings: Settings) -> None:
    """Nothing was sent: back to the queue, the attempt not counted.

    Retried through a database outage for as long as the lease lasts: a
    claim whose commit landed but whose reply was lost leaves ``sent_at``
    set, and if the sweep found it so it would ledger a call that was never made.
    Past the lease the sweep hands the item back (and, seeing ``sent_at``,
    ledgers the call as waste: it over-counts rather than misses).
    """
    try:
        with_db_retries(
            item, "handing the item back", lambda session: _hand_back(session, item, settings)
        )
    except Exception as exc:
        if not db.is_transient(exc):
            raise
        log.warning("item %d: database error handing the item back; the sweep will", item.item_id)


def _hand_back(session: Session, item: Owned, settings: Settings) -> bool:
    lease_s = settings.worker.queued_lease_s
    if isinstance(item, LostClaim):  # only that very claim
        return items.requeue_lost_claim(session, item, item.claim_token, lease_s)
    return items.requeue(session, item, 0.0, lease_s)


# Retrying a transaction while the database is away: first wait, doubling up to the cap.
DB_RETRY_FIRST_S = 0.1
DB_RETRY_MAX_S = 2.0
# A transaction PostgreSQL aborted for a deadlock or serialization failure runs again
# at once, up to this many times (then it is treated as any other error).
CONFLICT_RETRIES = 5


def with_db_retries(
    item: Owned,
    what: str,
    work: Callable[[Any], T],
    scope: Callable[[], AbstractContextManager[Any]] = session_scope,
) -> T:
    """Run ``work`` in a transaction (``scope``: a session, or :func:`db.autocommit` for
    one statement); on a database outage (dropped connection, refused connect, pool
    time-out) retry it with backoff for as long as our lease lasts.

    Used for what follows a provider call: the call is paid, so its outcome must
    not be dropped while the item is still ours. Past the lease the error is
    raised (the sweep then ledgers the call as waste and hands the item back).
    """
    delay_s = DB_RETRY_FIRST_S
    conflicts = 0
    while True:
        try:
            with scope() as session:
                return work(session)
        except Exception as exc:
            if db.is_conflict(exc) and conflicts < CONFLICT_RETRIES:
                # A deadlock or serialization failure: the other transaction went on,
                # ours was rolled back whole; run it again, lease or none (every state
                # move checks the attempt, so a stale one changes nothing).
                conflicts += 1
                log.warning(
                    "item %d: %s lost a lock conflict (%s), running it again",
                    item.item_id,
                    what,
                    getattr(getattr(exc, "orig", exc), "sqlstate", "?"),
                )
                continue
            left_s = _lease_left_s(item)
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


def _lease_left_s(item: Owned) -> float:
    """How long the item stays ours: its lease, as renewed by the worker's heartbeat
    while its call is in flight (:mod:`batchgen.worker.heartbeat`)."""
    from batchgen.worker.heartbeat import heartbeat  # imports this module's users

    if isinstance(item, Claimed):
        return heartbeat().lease_left_s(item)
    return item.lease_left_s()


def close_batch(batch_id: str, item_id: int) -> None:
    """Close the batch if this was its last item (best effort: the sweep also does it)."""
    try:
        with session_scope() as session:
            batches.finish_if_done(session, batch_id)
    except Exception as exc:
        if not db.is_transient(exc):
            raise
        log.warning("item %d: database error closing its batch; the sweep will", item_id)


def closing(session: Session, item: Claimed, progress: list[Progress]) -> None:
    """In the transaction that ended the item: close its batch if nothing of it is open
    (``progress`` receives where the batch stands, for :func:`after_commit`)."""
    progress.append(batches.close_if_done(session, item.batch_id))


def after_commit(item: Claimed, progress: list[Progress]) -> None:
    """Only items running elsewhere were open: look again now that ours is committed."""
    if progress and progress[-1] is Progress.TAIL:
        close_batch(item.batch_id, item.item_id)


def end(
    item: Claimed, status: ItemStatus, code: str, message: str, *, rate_limited: bool = False
) -> None:
    """End a running item (failed, expired, cancelled) and close its batch if done."""
    progress: list[Progress] = []

    def work(session: Session) -> None:
        if items.finish(session, item, status, code, message, rate_limited=rate_limited):
            closing(session, item, progress)

    with_db_retries(item, f"ending the item {status}", work)
    if progress:  # this attempt ended it: the item's trace gets its root
        tenant = str(item.tenant_id)
        tracing.ended(
            item.batch_id, item.item_id, tenant, item.attempt, status.value, item.created_at
        )
    after_commit(item, progress)
