"""The offload tick: provider jobs of the providers' Batch APIs (app/worker/offload_jobs.py)."""

from __future__ import annotations

from batchgen.config import get_settings
from batchgen.registry import get_registry
from batchgen.tasks.celery_app import celery_app
from batchgen.worker.dispatch import dispatch
from batchgen.worker.names import OFFLOAD_TASK
from batchgen.worker.offload_jobs import tick


# No task events, like the other ticks.
@celery_app.task(name=OFFLOAD_TASK, ignore_result=True, send_events=False)
def offload() -> int:
    """One tick; items it sent back online are released at once. Returns how many
    results it recorded."""
    registry, settings = get_registry(), get_settings()
    report = tick(registry, settings)
    if report.returned:
        dispatch(registry, settings)
    return report.recorded
