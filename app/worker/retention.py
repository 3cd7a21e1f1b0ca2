"""The retention pass (``batchgen.retention`` on the beat, every
``BATCHGEN_RETENTION_INTERVAL_S``): removes what finished more than
``BATCHGEN_RETENTION_DAYS`` ago, in small transactions (:mod:`batchgen.store.retention`);
does nothing while that setting is unset."""

from __future__ import annotations

import logging

from batchgen.config import Settings
from batchgen.store import retention, totals
from batchgen.store.db import session_scope

log = logging.getLogger(__name__)
BATCHES_PER_PASS = 100


def purge(settings: Settings) -> retention.Purged:
    """One pass: up to ``BATCHES_PER_PASS`` expired batches, each removed whole."""
    purged = retention.Purged()
    if settings.retention_days is None:
        return purged
    with session_scope() as session:  # what goes is counted in the totals first
        totals.roll_up(session, wait=True)
    with session_scope() as session:
        batch_ids = retention.expired_batches(session, settings.retention_days, BATCHES_PER_PASS)
    for batch_id in batch_ids:
        while True:
            with session_scope() as session:
                removed = retention.purge_items(session, batch_id, retention.ITEMS_PER_TRANSACTION)
            purged.items += removed
            if not removed:
                break
        with session_scope() as session:
            retention.purge_batch_row(session, batch_id)
        purged.batches += 1
    if purged.batches:
        log.info("retention: removed %d batches (%d items)", purged.batches, purged.items)
    return purged
