"""Batch-finished notifications in PostgreSQL (``batch_notifications``): written in the
transaction that finishes the batch, and kept with their attempts for the API. What is
sent and when it is retried: :mod:`batchgen.domain.notifications`.

Celery callbacks and webhooks are claimed with a lease (:func:`claim_send`: a short
transaction marks one ``sending``, its ``next_attempt_at`` the lease's end), sent with
no transaction open, and recorded in a second short transaction (:func:`record`); a
lease that ran out (a deliverer died) makes it due again. A host's signals are
claimed in the host's transaction (:func:`claim_signal`) and only for its own
batches (``batches.origin``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from batchgen.domain.notifications import Channel, DeliveryStatus, gives_up, payload
from batchgen.store.schema import Batch, BatchNotification, Tenant


def announce(session: Session, batch: Batch, counts: dict[str, int]) -> int:
    """In the transaction that finished ``batch``: one notification per channel it has
    (its task, its webhook or its tenant's, the host signal); returns how many."""
    tenant_url = session.scalar(select(Tenant.webhook_url).where(Tenant.id == batch.tenant_id))
    finished = int(batch.finished_at.timestamp()) if batch.finished_at else None
    data = payload(batch.id, batch.status, counts, finished)
    rows: list[dict[str, Any]] = []
    if batch.origin:  # a host app's batch: its signal command fires it
        rows.append({"channel": Channel.SIGNAL.value, "target": None})
    if batch.on_finished:
        rows.append({"channel": Channel.CELERY.value, "target": batch.on_finished})
    url = batch.webhook_url or tenant_url
    if url:
        rows.append({"channel": Channel.WEBHOOK.value, "target": url})
    if not rows:
        return 0
    result = session.execute(
        insert(BatchNotification)
        .values([{**r, "batch_id": batch.id, "payload": data} for r in rows])
        .on_conflict_do_nothing(index_elements=["batch_id", "channel"])
        .returning(BatchNotification.id)
    )
    return len(result.all())


@dataclass(frozen=True)
class Due:
    """A notification claimed for one delivery attempt."""

    id: int
    batch_id: str
    channel: Channel
    target: str | None
    payload: dict[str, Any]
    attempts: int  # before this one
    age_s: float
    queue: str | None  # a Celery task's queue (the batch's on_finished_queue)
    secret: str | None  # the tenant's webhook secret


_DUE_COLUMNS = (
    BatchNotification.id,
    BatchNotification.batch_id,
    BatchNotification.channel,
    BatchNotification.target,
    BatchNotification.payload,
    BatchNotification.attempts,
    func.extract("epoch", func.now() - BatchNotification.created_at).label("age_s"),
    Batch.on_finished_queue,
    Tenant.webhook_secret,
)


def _due(row: Any) -> Due:
    return Due(
        id=row.id,
        batch_id=row.batch_id,
        channel=Channel(row.channel),
        target=row.target,
        payload=row.payload,
        attempts=row.attempts,
        age_s=float(row.age_s),
        queue=row.on_finished_queue,
        secret=row.webhook_secret,
    )


def _lock_oldest(session: Session, *conditions: Any) -> Any:
    """The oldest due notification meeting ``conditions``, locked (``SKIP LOCKED``)."""
    return session.execute(
        select(*_DUE_COLUMNS)
        .join(Batch, Batch.id == BatchNotification.batch_id)
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(*conditions, BatchNotification.next_attempt_at <= func.now())
        .order_by(BatchNotification.next_attempt_at, BatchNotification.id)
        .limit(1)
        .with_for_update(skip_locked=True, of=BatchNotification)
    ).one_or_none()


def claim_send(session: Session, channels: list[Channel], lease_s: float) -> Due | None:
    """In a short transaction of its own: the oldest due notification of ``channels``
    (pending and due, or ``sending`` with its lease run out), marked ``sending`` until
    ``lease_s`` from now with its attempt counted; None: nothing due. Commit before
    sending; then :func:`record` the outcome."""
    row = _lock_oldest(
        session,
        BatchNotification.status.in_([DeliveryStatus.PENDING.value, DeliveryStatus.SENDING.value]),
        BatchNotification.channel.in_([c.value for c in channels]),
    )
    if row is None:
        return None
    session.execute(
        update(BatchNotification)
        .where(BatchNotification.id == row.id)
        .values(
            status=DeliveryStatus.SENDING.value,
            attempts=BatchNotification.attempts + 1,
            next_attempt_at=func.now() + dt.timedelta(seconds=lease_s),
        )
    )
    return _due(row)


def record(
    session: Session, due: Due, code: str | None, retry_in_s: float
) -> DeliveryStatus | None:
    """The outcome of a :func:`claim_send` attempt (``code`` None: delivered), if the
    claim is still this deliverer's (None: its lease ran out and another took it)."""
    if code is None:
        values: dict[str, Any] = {
            "status": DeliveryStatus.DELIVERED.value,
            "delivered_at": func.now(),
            "last_error": None,
        }
        status = DeliveryStatus.DELIVERED
    else:
        status = DeliveryStatus.FAILED if gives_up(due.age_s) else DeliveryStatus.PENDING
        values = {
            "status": status.value,
            "last_error": code[:200],
            "next_attempt_at": func.now() + dt.timedelta(seconds=retry_in_s),
        }
    result = session.execute(
        update(BatchNotification)
        .where(
            BatchNotification.id == due.id,
            BatchNotification.status == DeliveryStatus.SENDING.value,
            BatchNotification.attempts == due.attempts + 1,
        )
        .values(**values)
        .returning(BatchNotification.id)
    )
    return status if result.first() is not None else None


@contextmanager
def claim_signal(session: Session, origin: str) -> Iterator[Due | None]:
    """The oldest due signal of a batch of host app ``origin``, locked for the caller's
    transaction (None: nothing due); the host fires its receivers, then records the
    outcome with :func:`delivered` or :func:`failed` in the same transaction."""
    row = _lock_oldest(
        session,
        BatchNotification.status == DeliveryStatus.PENDING.value,
        BatchNotification.channel == Channel.SIGNAL.value,
        Batch.origin == origin,
    )
    yield None if row is None else _due(row)


def delivered(session: Session, due: Due) -> None:
    session.execute(
        update(BatchNotification)
        .where(BatchNotification.id == due.id)
        .values(
            status=DeliveryStatus.DELIVERED.value,
            attempts=BatchNotification.attempts + 1,
            delivered_at=func.now(),
            last_error=None,
        )
    )


def failed(session: Session, due: Due, code: str, retry_in_s: float) -> DeliveryStatus:
    """Record a failed attempt: tried again after ``retry_in_s``, or given up once the
    notification is a day old. Returns its status now."""
    status = DeliveryStatus.FAILED if gives_up(due.age_s) else DeliveryStatus.PENDING
    session.execute(
        update(BatchNotification)
        .where(BatchNotification.id == due.id)
        .values(
            status=status.value,
            attempts=BatchNotification.attempts + 1,
            last_error=code[:200],
            next_attempt_at=func.now() + dt.timedelta(seconds=retry_in_s),
        )
    )
    return status


def of_batch(session: Session, batch_id: str) -> list[dict[str, Any]]:
    """A batch's notifications and their delivery so far (the API's view). A tenant sees
    whether the last attempt failed (``last_error: "delivery_failed"``), never why: the
    reason (timeout, refused, a connection error) would map the receiver's network."""
    rows = session.scalars(
        select(BatchNotification)
        .where(BatchNotification.batch_id == batch_id)
        .order_by(BatchNotification.id)
    )
    return [
        {
            "id": n.id,
            "channel": n.channel,
            "target": n.target,
            "status": n.status,
            "attempts": n.attempts,
            "last_error": "delivery_failed" if n.last_error else None,
            "next_attempt_at": int(n.next_attempt_at.timestamp()),
            "delivered_at": int(n.delivered_at.timestamp()) if n.delivered_at else None,
            "created_at": int(n.created_at.timestamp()),
        }
        for n in rows
    ]


def delete_old(session: Session, retention_s: float) -> int:
    """Notifications older than ``retention_s`` go (a signal no host polled for, too)."""
    result = session.execute(
        delete(BatchNotification)
        .where(BatchNotification.created_at < func.now() - dt.timedelta(seconds=retention_s))
        .returning(BatchNotification.id)
    )
    return len(result.all())
