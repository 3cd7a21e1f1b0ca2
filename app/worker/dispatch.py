"""The dispatcher: releases pending items from PostgreSQL a little ahead of capacity.

Per model, it keeps at most ``ceil(max_concurrency * dispatch_ahead_factor)``
items queued or running (:func:`batchgen.domain.decisions.window_size`), so the
broker queue stays short, fairness is a query
(:file:`app/store/sql/dispatch_candidates.sql`), and cancelling is an UPDATE.
The release commits before publishing: if a publish is lost, the item's queued
lease runs out and the sweep hands it back.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.decisions import window_size
from batchgen.registry import ModelSpec, Registry
from batchgen.store import items
from batchgen.store.db import session_scope
from batchgen.worker import publish

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Release:
    ticket: items.Ticket
    model: str
    queue: str

    @property
    def item_id(self) -> int:
        return self.ticket.item_id


def release_model(session: Session, spec: ModelSpec, settings: Settings) -> list[Release]:
    """Release up to the model's free places, in fair order, in the caller's transaction."""
    window = window_size(spec.max_concurrency, settings.dispatch_ahead_factor)
    released = items.release(session, spec.name, window, settings.queued_lease_s)
    return [Release(ticket, spec.name, spec.queue) for ticket in released]


def release_all(session: Session, registry: Registry, settings: Settings) -> list[Release]:
    """One dispatch pass over every model."""
    released: list[Release] = []
    for spec in registry:
        released.extend(release_model(session, spec, settings))
    return released


def dispatch(registry: Registry, settings: Settings, models: Collection[str] | None = None) -> int:
    """Release what fits now (every model, or only ``models``) and publish it;
    returns how many items were released."""
    specs = [s for s in registry if models is None or s.name in models]
    with session_scope() as session:
        releases: list[Release] = []
        for spec in specs:
            releases.extend(release_model(session, spec, settings))
    publish.generate_many((r.item_id, r.model, r.ticket.to_message()) for r in releases)
    if releases:
        log.debug("dispatched %d items", len(releases))
    return len(releases)
