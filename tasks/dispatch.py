"""The dispatcher task: release pending items to their model group's queue."""

from __future__ import annotations

import logging

from batchgen.config import get_settings
from batchgen.registry import get_registry
from batchgen.store.db import session_scope
from batchgen.tasks.celery_app import celery_app
from batchgen.worker.dispatch import release_all

log = logging.getLogger(__name__)
WAKE_EXPIRES_S = 10


def dispatch_now() -> int:
    """Release what fits now and publish it; returns how many items were released.

    The release commits before publishing: if a publish is lost, the item's
    queued lease runs out and the sweep hands it back to the dispatcher.
    """
    from batchgen.tasks.generate import generate

    with session_scope() as session:
        releases = release_all(session, get_registry(), get_settings())
    for r in releases:
        generate.apply_async(args=[r.item_id], kwargs={"model": r.model})
    if releases:
        log.debug("dispatched %d items", len(releases))
    return len(releases)


@celery_app.task(name="batchgen.dispatch", ignore_result=True)
def dispatch() -> int:
    return dispatch_now()


def wake() -> None:
    """Ask a dispatcher to run soon (after a submit)."""
    # A wake-up is worthless later: the beat tick does the same work.
    dispatch.apply_async(expires=WAKE_EXPIRES_S)
