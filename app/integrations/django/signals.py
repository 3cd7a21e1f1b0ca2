"""The Django signal of a finished batch.

    from django.dispatch import receiver
    from batchgen.integrations.django.signals import batch_finished

    @receiver(batch_finished)
    def on_batch_finished(sender, batch_id, status, request_counts, **extra): ...

Sent with keyword arguments ``batch_id``, ``status``, ``request_counts``,
``finished_at`` (and ``type``) for the site's own batches only (those submitted
through its services, its management commands or its URL mount: ``origin`` is the
site's ``BATCHGEN_APP_ID``, default its ``SETTINGS_MODULE``), once per batch, in the
process running ``manage.py batchgen_signals --follow`` (nowhere else: not in the
site's web or Celery processes). A receiver that raises is logged; the others still
get the signal, and it is not sent again.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

from batchgen import python_api
from batchgen.integrations import APP_ID_KEY
from batchgen.worker import money_alerts

log = logging.getLogger(__name__)

batch_finished = Signal()
# Sent (sender "batchgen") when a dollar budget's period reached one of its soft
# thresholds, once per threshold and period, with the event's fields as keyword
# arguments (batchgen.worker.money_alerts.event), in the process that saw it.
budget_alert = Signal()
# The app id of a site configured with settings.configure() (no settings module).
DEFAULT_APP_ID = "django"


def app_id() -> str:
    """The site's id, its batches' ``origin``: ``BATCHGEN_APP_ID``, else the settings
    module's name."""
    from django.conf import settings

    return str(
        getattr(settings, APP_ID_KEY, None)
        or getattr(settings, "SETTINGS_MODULE", None)
        or DEFAULT_APP_ID
    )


def origin() -> str | None:
    """The site's id once the batchgen app is installed and ready (python_api's origin)."""
    from django.apps import apps
    from django.conf import settings

    if not settings.configured or not apps.ready:
        return None
    if not apps.is_installed("batchgen.integrations.django"):
        return None
    return app_id()


def fire(payload: dict[str, Any]) -> None:
    for receiver, result in batch_finished.send_robust(sender="batchgen", **payload):
        if isinstance(result, Exception):
            log.error(
                "batch_finished receiver %s failed for batch %s: %s",
                getattr(receiver, "__qualname__", receiver),
                payload.get("batch_id"),
                type(result).__name__,
            )


def deliver_signals(limit: int = 100) -> int:
    """Send :data:`batch_finished` for the site's batches that ended and were not
    announced yet, once each (what ``manage.py batchgen_signals`` runs)."""
    return python_api.deliver_signals(fire, limit, origin=app_id())


def _send_budget_alert(alert: money_alerts.Alert) -> None:
    if not budget_alert.receivers:
        return
    data = money_alerts.event(alert, money_alerts.tenant_name(alert))
    for receiver, result in budget_alert.send_robust(sender="batchgen", **data):
        if isinstance(result, Exception):
            log.error(
                "budget_alert receiver %s failed: %s",
                getattr(receiver, "__qualname__", receiver),
                type(result).__name__,
            )


money_alerts.on_alert(_send_budget_alert)
