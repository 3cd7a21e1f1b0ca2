"""Batch-finished notifications: the pure parts (what is sent, how it is signed, when
a failed delivery is tried again).

A finished batch gets one notification per channel (``batchgen.store.notifications``):
a Celery task the submitter named (``on_finished``), a webhook (the batch's
``webhook_url``, else its tenant's), and a host-process signal (Django, Flask).
Each is delivered at least once; a webhook's receiver tells a retry from the first
delivery by the notification's id (``X-Batchgen-Notification``).

Webhook signature, Stripe-style: header ``X-Batchgen-Signature: t=<unix seconds>,
v1=<hex HMAC-SHA256 of "<t>.<body>" with the tenant's webhook secret>``. A receiver
recomputes it over the raw body and refuses a timestamp older than a few minutes
(:func:`verify`), so a captured request cannot be replayed later.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from batchgen.errors import ValidationFailed

SIGNATURE_HEADER = "X-Batchgen-Signature"
ID_HEADER = "X-Batchgen-Notification"
# Retries: 10 s, doubling, at most an hour apart, for a day.
RETRY_FIRST_S = 10.0
RETRY_MAX_S = 3600.0
GIVE_UP_AFTER_S = 86400.0
REPLAY_TOLERANCE_S = 300


class Channel(StrEnum):
    CELERY = "celery"  # a Celery task of the host's, sent by name
    WEBHOOK = "webhook"  # an HTTP POST, signed
    SIGNAL = "signal"  # a Django or Flask signal, fired in a host process that polls


class DeliveryStatus(StrEnum):
    PENDING = "pending"
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


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The ``X-Batchgen-Signature`` header value for ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def verify(
    secret: str, header: str, body: bytes, now_s: float, tolerance_s: int = REPLAY_TOLERANCE_S
) -> bool:
    """A receiver's check: the header signs this body, recently."""
    try:
        parts = dict(p.split("=", 1) for p in header.split(","))
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs(now_s - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(signature(secret, timestamp, body), header)


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
