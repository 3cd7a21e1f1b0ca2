"""Delivering batch-finished notifications: a Celery task of the host's, sent by name,
and signed webhooks (the beat's ``batchgen.notify`` tick, every
``BATCHGEN_NOTIFY_INTERVAL_S``). Host-process signals are delivered by the host that
polls (:func:`batchgen.python_api.deliver_signals`).

Each notification is claimed in its own transaction (``FOR UPDATE SKIP LOCKED``), sent,
and recorded delivered, or failed with a code and a retry time, in the same
transaction: at least once, never lost (a deliverer that dies mid-send leaves it
pending for the next tick). A receiver tells a redelivery by its id header.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import httpx

from batchgen.config import Settings
from batchgen.domain.notifications import (
    ID_HEADER,
    SIGNATURE_HEADER,
    Channel,
    DeliveryStatus,
    body_bytes,
    retry_delay_s,
    signature,
)
from batchgen.store import notifications
from batchgen.store.db import session_scope
from batchgen.store.notifications import Due
from batchgen.worker.publish import celery_app

log = logging.getLogger(__name__)

# Celery's own default queue: where a host's worker listens unless told otherwise.
DEFAULT_CALLBACK_QUEUE = "celery"


@dataclass
class NotifyReport:
    delivered: int = 0
    failed_attempts: int = 0
    given_up: int = 0


def _send_celery(due: Due) -> None:
    assert due.target is not None
    celery_app.send_task(
        due.target,
        args=[due.batch_id],
        kwargs={"status": due.payload["status"], "request_counts": due.payload["request_counts"]},
        queue=due.queue or DEFAULT_CALLBACK_QUEUE,
    )


def _send_webhook(due: Due, timeout_s: float) -> str | None:
    """POST the signed body; None when the receiver took it (2xx), else a code."""
    assert due.target is not None
    body = body_bytes({**due.payload, "id": due.id})
    headers = {"Content-Type": "application/json", ID_HEADER: str(due.id)}
    if due.secret:
        headers[SIGNATURE_HEADER] = signature(due.secret, int(time.time()), body)
    try:
        response = httpx.post(due.target, content=body, headers=headers, timeout=timeout_s)
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as exc:
        return f"unreachable:{type(exc).__name__}"
    return None if response.is_success else f"http_{response.status_code}"


def deliver_due(settings: Settings, limit: int = 100) -> NotifyReport:
    """Deliver up to ``limit`` due notifications of the Celery and webhook channels."""
    report = NotifyReport()
    for _ in range(limit):
        with (
            session_scope() as session,
            notifications.claim(session, [Channel.CELERY, Channel.WEBHOOK]) as due,
        ):
            if due is None:
                break
            if due.channel is Channel.CELERY:
                try:
                    _send_celery(due)
                    error = None
                except Exception as exc:  # the broker refused or is away: retry later
                    error = f"broker:{type(exc).__name__}"
            else:
                error = _send_webhook(due, settings.webhook_timeout_s)
            if error is None:
                notifications.delivered(session, due)
                report.delivered += 1
                continue
            status = notifications.failed(
                session, due, error, retry_delay_s(due.attempts + 1, settings.notify_retry_first_s)
            )
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
