"""Delivering batch-finished notifications: a Celery task of the host's, sent by name to
its broker (``BATCHGEN_CALLBACK_BROKER_URL``), and signed webhooks. The beat's
``batchgen.notify`` tick runs this on a queue of its own (``batchgen.notify``, served
by the model workers), never on the dispatcher's threads. Host-process signals are
fired by the host's signal command (:func:`batchgen.python_api.deliver_signals`).

Each notification is claimed in a short transaction (``sending``, with a lease of
``BATCHGEN_WEBHOOK_TIMEOUT_S`` plus a margin), sent with no transaction open and no
row locked, and its outcome recorded in a second short transaction: at least once,
never lost (a deliverer that dies mid-send leaves a lease that runs out, and the
notification is due again). A receiver tells a redelivery by its ``webhook-id``.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

from celery import Celery

from batchgen.config import Settings
from batchgen.domain.notifications import (
    DEFAULT_CALLBACK_QUEUE,
    Channel,
    DeliveryStatus,
    body_bytes,
    retry_delay_s,
    signed_headers,
)
from batchgen.store import batch_notifications
from batchgen.store.batch_notifications import Due
from batchgen.store.db import session_scope
from batchgen.worker import webhooks
from batchgen.worker.publish import celery_app

log = logging.getLogger(__name__)

# A claim outlives the longest send by this much before another deliverer may take it.
LEASE_MARGIN_S = 30.0
# A host broker that is away: a few quick tries, then the notification's own retry.
CALLBACK_PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5}


@dataclass
class NotifyReport:
    delivered: int = 0
    failed_attempts: int = 0
    given_up: int = 0


@functools.cache
def callback_app(broker_url: str) -> Celery:
    """A Celery app that only publishes, to the host's broker (one per URL)."""
    # Never the process's current or default app (see batchgen.worker.publish).
    app = Celery("batchgen-callbacks", broker=broker_url, set_as_current=False, fixups=[])
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=5,
    )
    return app


def _send_celery(due: Due, settings: Settings) -> None:
    assert due.target is not None
    app = (
        callback_app(settings.webhooks.callback_broker_url)
        if settings.webhooks.callback_broker_url
        else celery_app
    )
    app.send_task(
        due.target,
        args=[due.batch_id],
        kwargs={"status": due.payload["status"], "request_counts": due.payload["request_counts"]},
        queue=due.queue or DEFAULT_CALLBACK_QUEUE,
        retry=True,
        retry_policy=CALLBACK_PUBLISH_RETRY,
    )


def _send_webhook(due: Due, settings: Settings) -> str | None:
    """POST the signed body; None when the receiver took it (2xx), else a code."""
    assert due.target is not None
    body = body_bytes({**due.payload, "id": due.id})
    headers = {"Content-Type": "application/json"}
    if due.secret:
        headers.update(signed_headers(due.secret, str(due.id), int(time.time()), body))
    return webhooks.post(
        due.target, body, headers, settings.webhooks.allow_nets, settings.webhooks.timeout_s
    )


def _send(due: Due, settings: Settings) -> str | None:
    if due.channel is Channel.WEBHOOK:
        return _send_webhook(due, settings)
    try:
        _send_celery(due, settings)
    except Exception as exc:  # the broker refused or is away: retry later
        return f"broker:{type(exc).__name__}"
    return None


def deliver_due(
    settings: Settings, limit: int = 100, budget_s: float | None = None
) -> NotifyReport:
    """Deliver up to ``limit`` due notifications of the Celery and webhook channels,
    claiming no new one after ``budget_s`` (default ``BATCHGEN_NOTIFY_INTERVAL_S``: the
    next tick, on another thread, takes over what is left)."""
    report = NotifyReport()
    lease_s = settings.webhooks.timeout_s + LEASE_MARGIN_S
    stop_at = time.monotonic() + (
        settings.webhooks.notify_interval_s if budget_s is None else budget_s
    )
    for _ in range(limit):
        if report.delivered + report.failed_attempts and time.monotonic() > stop_at:
            break
        with session_scope() as session:
            due = batch_notifications.claim_send(
                session, [Channel.CELERY, Channel.WEBHOOK], lease_s
            )
        if due is None:
            break
        error = _send(due, settings)  # no transaction open, no row locked
        delay_s = retry_delay_s(due.attempts + 1, settings.webhooks.notify_retry_first_s)
        with session_scope() as session:
            status = batch_notifications.record(session, due, error, delay_s)
        if error is None:
            report.delivered += 1
            continue
        report.failed_attempts += 1
        if status is DeliveryStatus.FAILED:
            report.given_up += 1
            log.error("notification %d (batch %s): given up: %s", due.id, due.batch_id, error)
        else:
            log.warning(
                "notification %d (batch %s): attempt %d failed: %s",
                due.id,
                due.batch_id,
                due.attempts + 1,
                error,
            )
    return report
