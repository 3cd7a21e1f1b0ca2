"""The sweep task: deadlines, expired leases, batches left open."""

from __future__ import annotations

from batchgen.config import get_settings
from batchgen.store.db import session_scope
from batchgen.tasks.celery_app import celery_app
from batchgen.tasks.dispatch import dispatch_now
from batchgen.worker.sweep import sweep as sweep_once


@celery_app.task(name="batchgen.sweep", ignore_result=True)
def sweep() -> int:
    with session_scope() as session:
        report = sweep_once(session, get_settings())
    if report.requeued:
        dispatch_now()
    return report.requeued
