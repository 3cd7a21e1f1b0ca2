"""The dispatcher: releases pending items from PostgreSQL a little ahead of capacity.

Per model, it keeps at most ``ceil(max_concurrency * dispatch_ahead_factor)``
items queued or running, so the broker queue stays short, fairness is a query
(:file:`app/store/sql/dispatch_candidates.sql`), and cancelling is an UPDATE.
Several dispatchers may run: a per-model advisory lock makes the in-flight
count and the release one critical section, and ``FOR UPDATE SKIP LOCKED``
guarantees that no item is released twice.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.status import ItemStatus
from batchgen.registry import ModelSpec, Registry
from batchgen.store.schema import Item
from batchgen.store.sqlfiles import query

# First key of the advisory locks this project takes (ASCII "BGDP").
ADVISORY_NAMESPACE = 0x42474450


@dataclass(frozen=True)
class Release:
    item_id: int
    model: str
    queue: str


def window_size(spec: ModelSpec, ahead_factor: float) -> int:
    """Items a model may have queued or running at once."""
    return max(1, math.ceil(spec.max_concurrency * ahead_factor))


def _lock_model(session: Session, model: str) -> bool:
    return bool(
        session.scalar(
            text("SELECT pg_try_advisory_xact_lock(:ns, hashtext(:model))"),
            {"ns": ADVISORY_NAMESPACE, "model": model},
        )
    )


def _in_flight(session: Session, model: str) -> int:
    return (
        session.scalar(
            select(func.count())
            .select_from(Item)
            .where(
                Item.model == model,
                Item.status.in_([ItemStatus.QUEUED.value, ItemStatus.RUNNING.value]),
            )
        )
        or 0
    )


def release_model(session: Session, spec: ModelSpec, settings: Settings) -> list[Release]:
    """Release up to the model's free slots, in fair order, in the caller's transaction."""
    if not _lock_model(session, spec.name):
        return []  # another dispatcher is releasing this model right now
    free = window_size(spec, settings.dispatch_ahead_factor) - _in_flight(session, spec.name)
    if free <= 0:
        return []
    candidates = list(
        session.scalars(query("dispatch_candidates"), {"model": spec.name, "limit": free})
    )
    if not candidates:
        return []
    locked = list(
        session.scalars(
            select(Item.id)
            .where(Item.id.in_(candidates), Item.status == ItemStatus.PENDING.value)
            .with_for_update(skip_locked=True)
        )
    )
    if not locked:
        return []
    now = func.now()
    session.execute(
        update(Item)
        .where(Item.id.in_(locked))
        .values(
            status=ItemStatus.QUEUED.value,
            queued_at=now,
            lease_expires_at=now + dt.timedelta(seconds=settings.queued_lease_s),
        )
    )
    return [Release(item_id, spec.name, spec.queue) for item_id in sorted(locked)]


def release_all(session: Session, registry: Registry, settings: Settings) -> list[Release]:
    """One dispatch pass over every model."""
    released: list[Release] = []
    for spec in registry:
        released.extend(release_model(session, spec, settings))
    return released
