"""Batch-finished notifications: the pure parts (what is sent, how it is signed, when
a failed delivery is tried again).

A finished batch gets one notification per channel (``batchgen.store.batch_notifications``):
a Celery task the submitter named (``on_finished``), a webhook (the batch's
``webhook_url``, else its tenant's), and a host-process signal (Django, Flask).
Each is delivered at least once; a webhook's receiver tells a retry from the first
delivery by its ``webhook-id`` header (the same on every attempt).

Webhooks are signed as the Standard Webhooks specification says
(https://www.standardwebhooks.com): headers ``webhook-id``, ``webhook-timestamp``
(unix seconds) and ``webhook-signature: v1,<base64 HMAC-SHA256 of
"{id}.{timestamp}.{body}">``, keyed with the base64-decoded part of the tenant's
``whsec_...`` secret. A receiver verifies with any Standard Webhooks library
(``standardwebhooks.Webhook(secret).verify(body, headers)``) or :func:`verify`, which
refuse a timestamp more than five minutes away, so a captured request cannot be
replayed later.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from batchgen.errors import ValidationFailed

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
SECRET_PREFIX = "whsec_"
# Retries: 10 s, doubling, at most an hour apart, for a day.
RETRY_FIRST_S = 10.0
RETRY_MAX_S = 3600.0
GIVE_UP_AFTER_S = 86400.0
REPLAY_TOLERANCE_S = 300
# Celery's own default queue: where a host's worker listens unless told otherwise.
DEFAULT_CALLBACK_QUEUE = "celery"


class Channel(StrEnum):
    CELERY = "celery"  # a Celery task of the host's, sent by name
    WEBHOOK = "webhook"  # an HTTP POST, signed
    SIGNAL = "signal"  # a Django or Flask signal, fired in a host process that polls


class DeliveryStatus(StrEnum):
    PENDING = "pending"
    SENDING = "sending"  # claimed by a deliverer until its lease ends
    DELIVERED = "delivered"
    FAILED = "failed"  # retried for GIVE_UP_AFTER_S without success


def payload(
    batch_id: str, status: str, request_counts: dict[str, int], finished_at: int | None
) -> dict[str, Any]:
    """What every channel carries: ids, a status and counts, never a prompt."""
    return {
        "type": "batch.finished",
        "batch_id": batch_id,
        "status": status,
        "request_counts": request_counts,
        "finished_at": finished_at,
    }


def body_bytes(data: dict[str, Any]) -> bytes:
    """The webhook body exactly as signed and sent."""
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_<base64>`` secret: its base64 part, decoded."""
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError("a webhook secret is 'whsec_' and base64") from exc


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value: ``v1,<base64 HMAC-SHA256>`` of
    ``{id}.{timestamp}.{body}``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    mac = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signed_headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers of one delivery."""
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: signature(secret, msg_id, timestamp, body),
    }


def verify(
    secret: str,
    headers: dict[str, str],
    body: bytes,
    now_s: float,
    tolerance_s: int = REPLAY_TOLERANCE_S,
) -> bool:
    """A receiver's check: one of the ``webhook-signature`` values (space-separated)
    signs this id, timestamp and body, and the timestamp is recent."""
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        msg_id = lower[ID_HEADER]
        timestamp = int(lower[TIMESTAMP_HEADER])
        offered = lower[SIGNATURE_HEADER].split()
    except (KeyError, ValueError):
        return False
    if abs(now_s - timestamp) > tolerance_s:
        return False
    expected = signature(secret, msg_id, timestamp, body)
    return any(hmac.compare_digest(expected, value) for value in offered)


def retry_delay_s(attempts: int, first_s: float = RETRY_FIRST_S) -> float:
    """Wait after the ``attempts``-th failed delivery: ``first_s`` (10 s) doubling, at
    most an hour."""
    return float(min(RETRY_MAX_S, first_s * 2 ** min(max(attempts - 1, 0), 30)))


def gives_up(age_s: float) -> bool:
    """A notification this old that still failed is given up (status ``failed``)."""
    return age_s >= GIVE_UP_AFTER_S


def check_webhook_url(url: str | None, field: str = "webhook_url") -> str | None:
    """An ``http(s)://host/...`` URL, or a precise :class:`ValidationFailed`."""
    if url is None or url == "":
        return None
    if not isinstance(url, str) or len(url) > 2000:
        raise ValidationFailed(f"{field} must be a URL of at most 2000 characters", field=field)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationFailed(f"{field} must be an http:// or https:// URL", field=field)
    return url


def check_task_name(name: str | None, field: str = "on_finished") -> str | None:
    """A dotted Celery task name (``myproj.tasks.batch_done``), or ValidationFailed."""
    if name is None or name == "":
        return None
    ok = (
        isinstance(name, str)
        and len(name) <= 200
        and all(part.isidentifier() for part in name.split("."))
    )
    if not ok:
        raise ValidationFailed(
            f"{field} must be a Celery task name like 'myproj.tasks.batch_done'", field=field
        )
    return name


def check_callback(
    task: str | None,
    queue: str | None,
    allowed_tasks: list[str],
    allowed_queues: list[str],
    default_queue: str,
) -> None:
    """``on_finished`` may name only a task of ``BATCHGEN_CALLBACK_TASKS`` and a queue of
    ``BATCHGEN_CALLBACK_QUEUES`` (the operator's lists): else a precise ValidationFailed.
    Without them a tenant could run any task a worker knows (``batchgen.generate``, a
    host's ``delete_account``) or make a broker create queues."""
    if task is None:
        if queue is not None:
            raise ValidationFailed(
                "on_finished_queue is only used with on_finished", field="on_finished_queue"
            )
        return
    if not allowed_tasks:
        raise ValidationFailed(
            "on_finished is not enabled here: the operator lists the task names it may "
            "name in BATCHGEN_CALLBACK_TASKS",
            field="on_finished",
        )
    if task not in allowed_tasks:
        raise ValidationFailed(
            f"on_finished {task!r} is not one of the tasks BATCHGEN_CALLBACK_TASKS allows: "
            f"{', '.join(sorted(allowed_tasks))}",
            field="on_finished",
        )
    chosen = queue or default_queue
    if chosen not in allowed_queues:
        raise ValidationFailed(
            f"on_finished_queue {chosen!r} is not one of the queues BATCHGEN_CALLBACK_QUEUES "
            f"allows: {', '.join(sorted(allowed_queues)) or '(none)'}",
            field="on_finished_queue",
        )
