"""Budget alerts as Standard Webhooks events, to the tenant's webhook and the
operator's (``money_webhook_url``), signed like the batches' (docs/money.md).

:mod:`batchgen.worker.money_holds` claims each soft threshold once per budget and period
(Redis ``SET NX``) and calls the hooks registered here (:func:`on_alert`: the Flask
and Django signals register theirs); :func:`send_webhooks`, always registered, posts
the event from a background thread (the call or dispatch that crossed the threshold
never waits on a receiver), retrying a failed delivery a few times. The event
carries ids, amounts and times, never a prompt:

    {"type": "budget.threshold", "tenant": "acme", "budget_id": 3, "key_id": null,
     "period": "day", "period_key": "d20261205", "threshold_pct": 80,
     "used_usd": "0.82", "limit_usd": "1", "resets_at": "2026-12-06T00:00:00+00:00"}
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen.config import get_settings
from batchgen.domain.billing import budget_maths as rules
from batchgen.domain.notifications import body_bytes, signed_headers
from batchgen.store import budget_rows
from batchgen.store.budget_rows import StoredBudget
from batchgen.store.db import session_scope
from batchgen.worker import webhooks

log = logging.getLogger(__name__)

EVENT_TYPE = "budget.threshold"
DELIVERY_TRIES = 4
RETRY_FIRST_S = 1.0


@dataclass(frozen=True)
class Alert:
    """A budget's period reached one of its thresholds (once per period)."""

    budget: StoredBudget
    period_key: str
    threshold_pct: int
    used_micros: int
    limit_micros: int
    resets_at: dt.datetime | None


AlertHook = Callable[[Alert], None]
_alert_hooks: list[AlertHook] = []


def on_alert(hook: AlertHook) -> AlertHook:
    """Register ``hook``: called once per threshold and period reached, in the process
    that saw it (a worker's dispatch, an API process's call)."""
    if hook not in _alert_hooks:
        _alert_hooks.append(hook)
    return hook


def remove_hook(hook: AlertHook) -> None:
    if hook in _alert_hooks:
        _alert_hooks.remove(hook)


def fire(alert: Alert) -> None:
    """Call every hook; one that raises is logged, the others still run."""
    for hook in list(_alert_hooks):
        try:
            hook(alert)
        except Exception as exc:  # an alert never stops a call
            log.warning("budget alert hook failed (%s)", type(exc).__name__)


def event(alert: Alert, tenant_name: str) -> dict[str, Any]:
    """The event's body (also the Flask/Django signals' keyword arguments)."""
    rule = alert.budget.rule
    return {
        "type": EVENT_TYPE,
        "tenant": tenant_name,
        "budget_id": alert.budget.id,
        "key_id": alert.budget.key_id,
        "period": rule.period.value,
        "period_key": alert.period_key,
        "threshold_pct": alert.threshold_pct,
        "used_usd": str(rules.to_usd(alert.used_micros)),
        "limit_usd": str(rules.to_usd(alert.limit_micros)),
        "resets_at": alert.resets_at.isoformat() if alert.resets_at else None,
    }


def tenant_name(alert: Alert) -> str:
    with session_scope() as session:
        return budget_rows.tenant_webhook(session, alert.budget.tenant_id)[0]


def _targets(alert: Alert) -> tuple[str, list[tuple[str, str]]]:
    settings = get_settings()
    with session_scope() as session:
        name, url, secret = budget_rows.tenant_webhook(session, alert.budget.tenant_id)
    targets = []
    if url and secret:
        targets.append((url, secret))
    if settings.money.webhook_url and settings.money.webhook_secret:
        targets.append((settings.money.webhook_url, settings.money.webhook_secret))
    return name, targets


def deliver(url: str, secret: str, data: dict[str, Any]) -> str | None:
    """Post one event (a few tries); None once delivered, else the last failure."""
    settings = get_settings()
    body = body_bytes(data)
    msg_id = f"msg_budget_{uuid.uuid4().hex}"
    failure: str | None = "not_sent"
    delay_s = RETRY_FIRST_S
    for _ in range(DELIVERY_TRIES):
        headers = {
            "content-type": "application/json",
            **signed_headers(secret, msg_id, int(time.time()), body),
        }
        failure = webhooks.post(
            url, body, headers, settings.webhooks.allow_nets, settings.webhooks.timeout_s
        )
        if failure is None:
            return None
        time.sleep(delay_s)
        delay_s *= 2
    log.warning("budget alert %s not delivered (%s)", msg_id, failure)
    return failure


def _send(alert: Alert) -> None:
    name, targets = _targets(alert)
    data = event(alert, name)
    for url, secret in targets:
        deliver(url, secret, data)


@on_alert
def send_webhooks(alert: Alert) -> None:
    """Post the alert to the tenant's and the operator's webhooks, in the background."""
    threading.Thread(target=_send, args=(alert,), name="batchgen-budget-alert", daemon=True).start()
