"""The dispatcher task: release pending items to their model group's queue."""

from __future__ import annotations

from batchgen.tasks.celery_app import celery_app
from batchgen.worker.messages import release
from batchgen.worker.names import DISPATCH_TASK


def dispatch_now() -> int:
    """Release what fits now for every model and publish it, in packs
    (:func:`batchgen.worker.messages.release`); returns how many."""
    return release()


# No task events: a tick every second would bury the items' tasks in Flower.
@celery_app.task(name=DISPATCH_TASK, ignore_result=True, send_events=False)
def dispatch() -> int:
    return dispatch_now()
