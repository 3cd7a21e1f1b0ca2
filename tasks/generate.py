"""The worker task: runs one ``batchgen.generate`` message (an item, or a pack of a
model's items: :mod:`batchgen.worker.messages`) and retries itself when items wait."""

from __future__ import annotations

from typing import Any

from celery import Task

from batchgen.errors import ItemFailed
from batchgen.tasks.celery_app import celery_app
from batchgen.telemetry import tracing
from batchgen.worker.messages import run_message
from batchgen.worker.names import GENERATE_TASK


# max_retries=None: a budget wait is not a failure and may repeat as often as
# needed; failure attempts are counted on the item in PostgreSQL instead. An item that
# failed for good ends its task FAILURE (ItemFailed: expected, logged without a trace).
# Request: a retry's ETA is on Redis's clock, read in this host's frame (worker/clock.py).
@celery_app.task(
    name=GENERATE_TASK,
    bind=True,
    ignore_result=True,
    max_retries=None,
    throws=(ItemFailed,),
    Request="batchgen.worker.clock:RedisClockRequest",
)
def generate(
    self: Task,
    item_id: int,
    model: str | None = None,
    ticket: dict[str, Any] | None = None,
    more: list[Any] | None = None,
) -> str:
    """Run item ``item_id``, then the items of ``more`` (``[[id, ticket], ...]``, a pack).
    ``model`` routes the message to its group's queue; ``ticket`` is what the gate
    decides on before the claim."""
    with tracing.delivery(self.request):  # the trace context its message carried
        ran = run_message(item_id, model, ticket, more)
    if ran.retry is not None:
        retry = ran.retry
        with tracing.delivery(self.request):  # the retry's message carries it on
            raise self.retry(args=[retry.item_id], kwargs=retry.kwargs, countdown=retry.countdown_s)
    return ran.summary
