"""Every state change of an item row, as a conditional UPDATE.

Each move names the state it expects, so a duplicate delivery, a cancelled
or a finished item simply matches nothing.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from batchgen.domain.deadlines import carried_forward
from batchgen.domain.status import ItemStatus
from batchgen.store.schema import Batch, Item, Tenant


@dataclass(frozen=True)
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
    now: dt.datetime
    # time.monotonic() taken no later than the start of the claiming transaction
    # (whose now() is ``now``), so that :meth:`db_now` never runs behind.
    read_mono_s: float

    def db_now(self, mono_s: float | None = None) -> dt.datetime:
        """PostgreSQL's clock at ``mono_s`` (default: now) as seen from this process."""
        return carried_forward(
            self.now, self.read_mono_s, time.monotonic() if mono_s is None else mono_s
        )

    def lease_left_s(self) -> float:
        """Seconds until this attempt's lease runs out (negative once it has)."""
        return (self.lease_expires_at - self.db_now()).total_seconds()


def claim(
    session: Session, item_id: int, lease_s: float, read_mono_s: float | None = None
) -> Claimed | None:
    """``queued → running`` with a lease; None when the item is not ours to run.

    ``read_mono_s``: ``time.monotonic()`` from before the session's transaction
    began (default: now, exact when the claim is the transaction's first statement).
    """
    mono_s = time.monotonic() if read_mono_s is None else read_mono_s
    now = func.now()
    row = session.execute(
        update(Item)
        .where(
            Item.id == item_id,
            Item.status == ItemStatus.QUEUED.value,
            Item.deadline_at > now,
            Tenant.id == Item.tenant_id,
        )
        .values(
            status=ItemStatus.RUNNING.value,
            attempts=Item.attempts + 1,
            started_at=now,
            lease_expires_at=now + dt.timedelta(seconds=lease_s),
        )
        .returning(
            Item.id,
            Item.batch_id,
            Item.tenant_id,
            Item.model,
            Item.body,
            Item.attempts,
            Item.deadline_at,
            Item.created_at,
            Item.started_at,
            Item.prompt_tokens_est,
            Item.max_tokens,
            Tenant.tokens_per_min,
            Item.lease_expires_at,
            now,
        )
    ).one_or_none()
    if row is None:
        return None
    values: tuple[Any, ...] = (*row, mono_s)
    return Claimed(*values)


def expire_if_due(session: Session, item_id: int) -> bool:
    """A queued item whose deadline passed becomes expired without any call."""
    result = session.execute(
        update(Item)
        .where(
            Item.id == item_id,
            Item.status.in_([ItemStatus.QUEUED.value, ItemStatus.PENDING.value]),
            Item.deadline_at <= func.now(),
        )
        .values(
            status=ItemStatus.EXPIRED.value,
            finished_at=func.now(),
            lease_expires_at=None,
            error_code="expired",
            last_error="deadline passed before the item could run",
        )
        .returning(Item.id)
    )
    return result.scalar_one_or_none() is not None


def _owned(item: Claimed) -> Any:
    """WHERE clause: the item is still running under this very attempt."""
    return (
        (Item.id == item.item_id)
        & (Item.status == ItemStatus.RUNNING.value)
        & (Item.attempts == item.attempt)
    )


def finish_failed(
    session: Session, item: Claimed, code: str, message: str, status: ItemStatus = ItemStatus.FAILED
) -> bool:
    result = session.execute(
        update(Item)
        .where(_owned(item))
        .values(
            status=status.value,
            finished_at=func.now(),
            lease_expires_at=None,
            error_code=code,
            last_error=message,
        )
        .returning(Item.id)
    )
    return result.scalar_one_or_none() is not None


def mark_sent(session: Session, item: Claimed) -> bool:
    """Right before the provider request: False when a cancel got there first.

    A cancel ends running items whose ``sent_at`` is NULL; both statements
    update this row, so exactly one of them wins. Hence, once a cancel has
    returned, no new provider request starts for that batch.
    """
    result = session.execute(
        update(Item).where(_owned(item)).values(sent_at=func.now()).returning(Item.id)
    )
    return result.scalar_one_or_none() is not None


def unclaim(session: Session, item: Claimed, wait_s: float, lease_s: float) -> bool:
    """A short budget wait: back to queued, the attempt not counted, the lease
    covering the wait (the task retries itself after ``wait_s``)."""
    result = session.execute(
        update(Item)
        .where(_owned(item))
        .values(
            status=ItemStatus.QUEUED.value,
            attempts=Item.attempts - 1,
            sent_at=None,
            lease_expires_at=func.now() + dt.timedelta(seconds=wait_s + lease_s),
        )
        .returning(Item.id)
    )
    return result.scalar_one_or_none() is not None


def defer(session: Session, item: Claimed, wait_s: float, reason: str) -> bool:
    """A long budget wait: back to PostgreSQL, released again after ``wait_s``;
    the attempt is not counted."""
    result = session.execute(
        update(Item)
        .where(_owned(item))
        .values(
            status=ItemStatus.PENDING.value,
            attempts=Item.attempts - 1,
            sent_at=None,
            not_before=func.now() + dt.timedelta(seconds=wait_s),
            lease_expires_at=None,
            error_code="budget_wait",
            last_error=reason,
        )
        .returning(Item.id)
    )
    return result.scalar_one_or_none() is not None


def reschedule(session: Session, item: Claimed, wait_s: float, code: str, message: str) -> bool:
    """Back to pending, not before ``now + wait_s``: the retry goes through the dispatcher.

    False when the batch was cancelled meanwhile (the item must not run again).
    """
    cancelled = (
        select(Batch.id)
        .where(Batch.id == Item.batch_id, Batch.cancel_requested_at.is_not(None))
        .exists()
    )
    result = session.execute(
        update(Item)
        .where(_owned(item), ~cancelled)
        .values(
            status=ItemStatus.PENDING.value,
            not_before=func.now() + dt.timedelta(seconds=wait_s),
            lease_expires_at=None,
            sent_at=None,
            error_code=code,
            last_error=message,
        )
        .returning(Item.id)
    )
    return result.scalar_one_or_none() is not None
