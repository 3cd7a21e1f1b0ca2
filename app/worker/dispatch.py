"""The dispatcher: releases pending items from PostgreSQL a little ahead of capacity.

Per model, it keeps at most ``ceil(max_concurrency * dispatch_ahead_factor)``
items queued or running (:func:`batchgen.domain.lifecycle.decisions.window_size`), so the
broker queue stays short, fairness is deficit round robin across the tenants with
ready work (:mod:`batchgen.domain.scheduling.round_robin`, :mod:`batchgen.store.rounds`), and
cancelling is an UPDATE.
The release commits before publishing: if a publish is lost, the item's queued
lease runs out and the sweep hands it back. A refill from a worker process may put
several items of a model whose calls are short in one message
(:mod:`batchgen.worker.packs`); the window then grows with the pack.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.lifecycle.decisions import split_into_packs, window_size
from batchgen.registry import ModelSpec, Registry
from batchgen.store import items, rounds
from batchgen.store.db import session_scope
from batchgen.worker import money_holds, publish
from batchgen.worker.packs import PackItem, message_of, pack_wait_s

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Release:
    ticket: items.Ticket
    model: str
    queue: str

    @property
    def item_id(self) -> int:
        return self.ticket.item_id


def release_model(
    session: Session,
    spec: ModelSpec,
    settings: Settings,
    pack_items: int = 1,
    overlap: bool = False,
) -> list[Release]:
    """Release up to the model's free places, in fair order, in the caller's transaction
    (a window for messages of ``pack_items`` items: :func:`window_size`; ``overlap``:
    the pack's calls overlap, each holding a slot, so the window counts items)."""
    window = window_size(
        spec.max_concurrency, settings.worker.dispatch_ahead_factor, 1 if overlap else pack_items
    )
    lease_s = settings.worker.queued_lease_s
    if pack_items > 1:  # an item may wait in its pack until it is run or handed back
        lease_s += pack_wait_s(spec, settings)
    released = rounds.release(session, spec.name, window, lease_s, admit=money_holds.admit_picks)
    return [Release(ticket, spec.name, spec.queue) for ticket in released]


def release_all(session: Session, registry: Registry, settings: Settings) -> list[Release]:
    """One dispatch pass over every model."""
    released: list[Release] = []
    for spec in registry:
        released.extend(release_model(session, spec, settings))
    return released


def dispatch(
    registry: Registry,
    settings: Settings,
    models: Collection[str] | None = None,
    pack_items: Callable[[str], int] | None = None,
    overlapping: Callable[[str], bool] | None = None,
) -> int:
    """Release what fits now (every model, or only ``models``) and publish it, each
    model's items in messages of ``pack_items(model)`` (default one: a process that
    runs no calls knows no pace; ``overlapping(model)``: those packs' calls overlap);
    returns how many items were released."""
    specs = [s for s in registry if models is None or s.name in models]
    messages: list[tuple[int, str, dict[str, Any] | None, list[Any] | None]] = []
    released = 0
    names = [spec.name for spec in specs]
    with session_scope() as session:
        # A tick (every model) first asks which have work: most are idle most of the
        # time. A refill names its model because it has just freed places there.
        with_work = items.models_with_work(session, names) if models is None else set(names)
        for spec in specs:
            if spec.name not in with_work:
                continue  # nothing pending: its round would release nothing
            size = pack_items(spec.name) if pack_items is not None else 1
            overlap = overlapping(spec.name) if overlapping is not None else False
            releases = release_model(session, spec, settings, size, overlap)
            released += len(releases)
            for pack in split_into_packs(releases, size, alone=lambda r: r.ticket.urgent):
                item_id, ticket, more = message_of(
                    [PackItem(r.item_id, r.ticket.to_message()) for r in pack]
                )
                messages.append((item_id, spec.name, ticket, more))
    publish.generate_many(messages)
    if released:
        log.debug("dispatched %d items in %d messages", released, len(messages))
    return released
