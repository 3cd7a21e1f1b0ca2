"""The worker task: one item per message; the message carries the item id only."""

from __future__ import annotations

from app.config import get_settings
from app.execution import run_item
from app.registry import get_registry
from tasks.celery_app import celery_app
from tasks.dispatch import dispatch_now


@celery_app.task(name="batchgen.generate", ignore_result=True)
def generate(item_id: int, model: str | None = None) -> str:
    """Run item ``item_id``. ``model`` only routes the message to its group's queue."""
    verdict = run_item(item_id, get_registry(), get_settings())
    if verdict != "skipped":
        dispatch_now()  # a slot freed: refill it without waiting for the beat tick
    return verdict
