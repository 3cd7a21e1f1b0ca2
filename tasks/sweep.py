"""The sweep task: deadlines, expired leases, batches left open."""

from __future__ import annotations

from batchgen.config import get_settings
from batchgen.db import session_scope
from batchgen.recovery import sweep as sweep_once
from batchgen.tasks.celery_app import celery_app
from batchgen.tasks.dispatch import dispatch_now


@celery_app.task(name="batchgen.sweep", ignore_result=True)
def sweep() -> int:
    with session_scope() as session:
        report = sweep_once(session, get_settings())
    if report.requeued:
        dispatch_now()
    return report.requeued
