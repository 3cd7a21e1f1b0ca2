"""The dispatcher task: release pending items to their model group's queue."""

from __future__ import annotations

from batchgen.config import get_settings
from batchgen.registry import get_registry
from batchgen.tasks.celery_app import celery_app
from batchgen.worker.dispatch import dispatch as release_and_publish
from batchgen.worker.names import DISPATCH_TASK


def dispatch_now() -> int:
    """Release what fits now for every model and publish it; returns how many."""
    return release_and_publish(get_registry(), get_settings())


# No task events: a tick every second would bury the items' tasks in Flower.
@celery_app.task(name=DISPATCH_TASK, ignore_result=True, send_events=False)
def dispatch() -> int:
    return dispatch_now()
