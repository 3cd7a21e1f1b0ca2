"""The Celery application, and publishing by task name.

Library code sends messages by name (``send_task``) through the router of
:mod:`batchgen.celeryconfig`, so nothing here imports :mod:`batchgen.tasks`
(which registers the tasks on this same application for the worker). Every
message carries ids only: an item id and its model name (for routing), a job
name and a date.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from celery import Celery

from batchgen.telemetry import tracing
from batchgen.worker.names import COLLECT_TASK, DISPATCH_TASK, GENERATE_TASK


class BatchgenCelery(Celery):
    """Celery, with every countdown fitted to the broker on its way out (retries
    included: ``Task.retry`` publishes through :meth:`send_task` too).

    * RabbitMQ: a countdown under one second would make Celery's native delayed
      delivery raise (see :func:`batchgen.celeryconfig.countdown_for_broker`); it is
      rounded up. The broker holds the message for a relative delay, so no host's
      clock matters.
    * Redis: the message carries an absolute ETA, which Celery would take from this
      host's wall clock; it is taken from Redis's clock (the one the budget keeps)
      instead, and read back in the receiving host's frame
      (:mod:`batchgen.worker.clock`), so no host's clock running ahead or behind holds
      a retry back or runs it early. If Redis cannot say, this host's clock it is.
    """

    def send_task(self, name: str, *args: Any, **options: Any) -> Any:
        from batchgen.celeryconfig import countdown_for_broker, is_amqp
        from batchgen.worker.clock import eta_on_redis_clock

        url = str(self.conf.broker_url)
        if len(args) == 3:  # (args, kwargs, countdown), positional
            options["countdown"], args = args[2], args[:2]
        countdown = options.get("countdown")
        if countdown is not None and is_amqp(url):
            options["countdown"] = countdown_for_broker(float(countdown), url)
        elif countdown is not None and options.get("eta") is None:
            eta = eta_on_redis_clock(float(countdown))
            if eta is not None:
                options["eta"], options["countdown"] = eta, None
        if name == GENERATE_TASK:  # the item's trace context, in the message's headers
            tracing.carry(options, *args)
        return super().send_task(name, *args, **options)


# A library's app, never a host's: a host's current app (set_as_current) and its default
# one (Celery's Django fix-up takes the default for the first app it meets) stay the
# host's, so a host's @shared_task publishes to its own broker, in every thread.
# batchgen's own worker and beat make this app current themselves (celery -A).
celery_app = BatchgenCelery(
    "batchgen",
    set_as_current=False,
    fixups=[],
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

log = logging.getLogger(__name__)
# A wake-up is worthless later: the beat tick does the same work.
WAKE_EXPIRES_S = 10


def generate(
    item_id: int,
    model: str,
    ticket: dict[str, Any] | None = None,
    producer: Any = None,
    more: list[Any] | None = None,
) -> None:
    """Publish one released item, or a pack (its first item, and ``more``:
    ``[[id, ticket], ...]``, :mod:`batchgen.worker.packs`), to its model group's queue
    (``ticket``: :meth:`batchgen.store.items.Ticket.to_message`)."""
    kwargs: dict[str, Any] = {"model": model}
    if ticket is not None:
        kwargs["ticket"] = ticket
    if more:
        kwargs["more"] = more
    celery_app.send_task(GENERATE_TASK, args=[item_id], kwargs=kwargs, producer=producer)


def generate_many(
    messages: Iterable[tuple[int, str, dict[str, Any] | None, list[Any] | None]],
) -> None:
    """Publish messages (id, model, ticket, more) through one producer, buffered into one
    pipeline where the broker's transport can (kombu's ``Producer.batch``, Redis); a
    failed flush raises, and the items it held wait for the sweep like any lost message."""
    with celery_app.producer_or_acquire() as producer:
        batch = getattr(producer, "batch", None)  # kombu 5.7 and later
        with batch() if batch is not None else contextlib.nullcontext():
            for item_id, model, ticket, more in messages:
                generate(item_id, model, ticket, producer=producer, more=more)


def wake_dispatcher() -> None:
    """Ask a dispatcher to run soon (after a submit, or once a slot freed)."""
    celery_app.send_task(DISPATCH_TASK, expires=WAKE_EXPIRES_S)


def wake_dispatcher_quietly() -> None:
    """:func:`wake_dispatcher`, best effort: it never raises. The work is committed
    already and the beat tick releases it anyway, so a failure here (the broker down)
    is logged, never answered."""
    try:
        wake_dispatcher()
    except Exception as exc:
        log.warning(
            "could not wake the dispatcher (%s); the next beat tick will release the work",
            type(exc).__name__,
        )


def collect_later(job_name: str, day: str, countdown_s: float) -> None:
    """Schedule the collection of a nightly job's output."""
    celery_app.send_task(COLLECT_TASK, args=[job_name, day], countdown=countdown_s)
