"""Batch-finished notifications in PostgreSQL (``batch_notifications``): written in the
transaction that finishes the batch, claimed for delivery one at a time (``FOR UPDATE
SKIP LOCKED``: many deliverers, each notification once at a time), and kept with
their attempts for the API. What is sent and when it is retried:
:mod:`batchgen.domain.notifications`.
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
    rows: list[dict[str, Any]] = [{"channel": Channel.SIGNAL.value, "target": None}]
    if batch.on_finished:
        rows.append({"channel": Channel.CELERY.value, "target": batch.on_finished})
    url = batch.webhook_url or tenant_url
    if url:
        rows.append({"channel": Channel.WEBHOOK.value, "target": url})
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


@contextmanager
def claim(session: Session, channels: list[Channel]) -> Iterator[Due | None]:
    """The oldest due notification of ``channels``, locked for the caller's transaction
    (None: nothing due); record the attempt with :func:`delivered` or :func:`failed`
    in the same transaction."""
    row = session.execute(
        select(
            BatchNotification.id,
            BatchNotification.batch_id,
            BatchNotification.channel,
            BatchNotification.target,
            BatchNotification.payload,
            BatchNotification.attempts,
            func.extract("epoch", func.now() - BatchNotification.created_at).label("age_s"),
        )
        .where(
            BatchNotification.status == DeliveryStatus.PENDING.value,
            BatchNotification.channel.in_([c.value for c in channels]),
            BatchNotification.next_attempt_at <= func.now(),
        )
        .order_by(BatchNotification.next_attempt_at, BatchNotification.id)
        .limit(1)
        .with_for_update(skip_locked=True, of=BatchNotification)
    ).one_or_none()
    if row is None:
        yield None
        return
    batch = session.execute(
        select(Batch.on_finished_queue, Tenant.webhook_secret)
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(Batch.id == row.batch_id)
    ).one()
    yield Due(
        id=row.id,
        batch_id=row.batch_id,
        channel=Channel(row.channel),
        target=row.target,
        payload=row.payload,
        attempts=row.attempts,
        age_s=float(row.age_s),
        queue=batch.on_finished_queue,
        secret=batch.webhook_secret,
    )


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
    """A batch's notifications and their delivery so far (the API's view)."""
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
            "last_error": n.last_error,
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
