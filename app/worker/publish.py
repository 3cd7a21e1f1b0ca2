"""The Celery application, and publishing by task name.

Library code sends messages by name (``send_task``) through the router of
:mod:`batchgen.celeryconfig`, so nothing here imports :mod:`batchgen.tasks`
(which registers the tasks on this same application for the worker). Every
message carries ids only: an item id and its model name (for routing), a job
name and a date.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from celery import Celery

from batchgen.worker.names import COLLECT_TASK, DISPATCH_TASK, GENERATE_TASK

celery_app = Celery(
    "batchgen",
    include=[
        "batchgen.tasks.generate",
        "batchgen.tasks.dispatch",
        "batchgen.tasks.sweep",
        "batchgen.tasks.nightly",
        "batchgen.tasks.offload",
        "batchgen.tasks.notify",
        "batchgen.tasks.retention",
    ],
)
celery_app.config_from_object("batchgen.celeryconfig")

# A wake-up is worthless later: the beat tick does the same work.
WAKE_EXPIRES_S = 10


def generate(
    item_id: int, model: str, ticket: dict[str, Any] | None = None, producer: Any = None
) -> None:
    """Publish one released item to its model group's queue (``ticket``:
    :meth:`batchgen.store.items.Ticket.to_message`)."""
    kwargs: dict[str, Any] = {"model": model}
    if ticket is not None:
        kwargs["ticket"] = ticket
    celery_app.send_task(GENERATE_TASK, args=[item_id], kwargs=kwargs, producer=producer)


def generate_many(messages: Iterable[tuple[int, str, dict[str, Any]]]) -> None:
    """Publish released items (id, model, ticket) through one producer, buffered into one
    pipeline where the broker's transport can (kombu's ``Producer.batch``, Redis); a
    failed flush raises, and the items it held wait for the sweep like any lost message."""
    with celery_app.producer_or_acquire() as producer:
        batch = getattr(producer, "batch", None)  # kombu 5.7 and later
        with batch() if batch is not None else contextlib.nullcontext():
            for item_id, model, ticket in messages:
                generate(item_id, model, ticket, producer=producer)


def wake_dispatcher() -> None:
    """Ask a dispatcher to run soon (after a submit, or once a slot freed)."""
    celery_app.send_task(DISPATCH_TASK, expires=WAKE_EXPIRES_S)


def collect_later(job_name: str, day: str, countdown_s: float) -> None:
    """Schedule the collection of a nightly job's output."""
    celery_app.send_task(COLLECT_TASK, args=[job_name, day], countdown=countdown_s)
