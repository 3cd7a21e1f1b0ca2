"""The retention task: finished batches past BATCHGEN_RETENTION_DAYS
(app/worker/retention_tick.py)."""

from __future__ import annotations

from batchgen.config import get_settings
from batchgen.tasks.celery_app import celery_app
from batchgen.worker.names import RETENTION_TASK
from batchgen.worker.retention_tick import purge


@celery_app.task(name=RETENTION_TASK, ignore_result=True, send_events=False)
def retention() -> int:
    """One tick; returns how many batches it removed."""
    return purge(get_settings()).batches
