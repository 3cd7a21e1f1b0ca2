"""The sweep task: the gate's state in Redis (rebuilt if lost), deadlines, expired
leases, batches left open; then the totals' roll-up (batchgen.store.totals)."""

from __future__ import annotations

from batchgen.config import get_settings
from batchgen.limits.backend import get_redis
from batchgen.registry import get_registry
from batchgen.store import totals
from batchgen.store.db import session_scope
from batchgen.tasks.celery_app import celery_app
from batchgen.worker.dispatch import dispatch
from batchgen.worker.gate_recovery import ensure_quietly
from batchgen.worker.names import SWEEP_TASK
from batchgen.worker.sweep import sweep as sweep_once


# No task events: a sweep every few seconds would bury the items' tasks in Flower.
@celery_app.task(name=SWEEP_TASK, ignore_result=True, send_events=False)
def sweep() -> int:
    registry, settings = get_registry(), get_settings()
    ensure_quietly(get_redis(), registry, settings)
    with session_scope() as session:
        report = sweep_once(session, settings, registry)
    with session_scope() as session:  # apart: the roll-up's lock is not held meanwhile
        totals.roll_up(session)
    if report.requeued:
        dispatch(registry, settings)
    return report.requeued
