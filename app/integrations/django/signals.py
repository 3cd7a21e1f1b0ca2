"""The Django signal of a finished batch.

    from django.dispatch import receiver
    from batchgen.integrations.django.signals import batch_finished

    @receiver(batch_finished)
    def on_batch_finished(sender, batch_id, status, request_counts, **extra): ...

Sent with keyword arguments ``batch_id``, ``status``, ``request_counts``,
``finished_at`` (and ``type``), at least once per batch across the site's processes:
from a thread when ``BATCHGEN_SIGNAL_POLL_S`` is set (seconds between polls), or by
:func:`deliver_signals` (``manage.py batchgen_signals`` runs it).
"""

from __future__ import annotations

from typing import Any

from django.dispatch import Signal

from batchgen import python_api

batch_finished = Signal()


def fire(payload: dict[str, Any]) -> None:
    batch_finished.send(sender="batchgen", **payload)


def deliver_signals(limit: int = 100) -> int:
    """Send :data:`batch_finished` for every batch that ended and was not announced yet."""
    return python_api.deliver_signals(fire, limit)
