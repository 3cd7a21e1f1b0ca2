"""The retention tick (``batchgen.retention`` on the beat, every
``BATCHGEN_RETENTION_INTERVAL_S``): removes what finished more than
``BATCHGEN_RETENTION_DAYS`` ago, chunk after chunk within ``BATCHGEN_RETENTION_BUDGET_S``,
in small transactions (:mod:`batchgen.store.retention`); does nothing while that
setting is unset."""

from __future__ import annotations

import logging
import time

from batchgen.config import Settings
from batchgen.store import retention, totals
from batchgen.store.db import session_scope

log = logging.getLogger(__name__)


def purge(settings: Settings) -> retention.Purged:
    """One tick: chunks of ``BATCHGEN_RETENTION_CHUNK_BATCHES`` expired batches, each
    batch removed whole, until none is left or the time budget is spent (checked between
    chunks: a tick always finishes the chunk it started)."""
    purged = retention.Purged()
    if settings.retention.days is None:
        return purged
    until_mono_s = time.monotonic() + settings.retention.budget_s
    with session_scope() as session:  # what goes is counted in the totals first
        totals.roll_up(session, wait=True)
    while True:
        with session_scope() as session:
            batch_ids = retention.expired_batches(
                session, settings.retention.days, settings.retention.chunk_batches
            )
        for batch_id in batch_ids:
            purged.items += _purge_batch(batch_id)
            purged.batches += 1
        if len(batch_ids) < settings.retention.chunk_batches:
            break  # nothing expired is left
        if time.monotonic() >= until_mono_s:
            purged.budget_spent = True
            break
    _report(purged, settings)
    return purged


def _purge_batch(batch_id: str) -> int:
    """Remove one batch: its items a bounded transaction at a time, then its row;
    returns how many items went."""
    removed_items = 0
    while True:
        with session_scope() as session:
            removed = retention.purge_items(session, batch_id, retention.ITEMS_PER_TRANSACTION)
        removed_items += removed
        if not removed:
            break
    with session_scope() as session:
        retention.purge_batch_row(session, batch_id)
    return removed_items


def _report(purged: retention.Purged, settings: Settings) -> None:
    if purged.budget_spent:
        # Not an error (the next tick goes on), but a history that outgrows every
        # tick's budget needs a larger BATCHGEN_RETENTION_BUDGET_S.
        log.warning(
            "retention: removed %d batches (%d items) in its budget of %.0f s; more are "
            "expired, the next tick goes on",
            purged.batches,
            purged.items,
            settings.retention.budget_s,
        )
    elif purged.batches:
        log.info("retention: removed %d batches (%d items)", purged.batches, purged.items)
