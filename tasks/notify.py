"""The notification tick: batch-finished Celery callbacks and webhooks (app/worker/notify.py)."""

from __future__ import annotations

from batchgen.config import get_settings
from batchgen.tasks.celery_app import celery_app
from batchgen.worker.names import NOTIFY_TASK
from batchgen.worker.notify import deliver_due


# No task events, like the other ticks.
@celery_app.task(name=NOTIFY_TASK, ignore_result=True, send_events=False)
def notify() -> int:
    """Deliver what is due; returns how many were delivered."""
    return deliver_due(get_settings()).delivered
