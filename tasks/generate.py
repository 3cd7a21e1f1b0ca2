"""The worker task: one item per message; the message carries the item id, its
model's name (which routes it to the model group's queue) and its ticket (batch,
tenant, attempt, token counts: ids and numbers, never text)."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

from celery import Task

from batchgen.config import get_settings
from batchgen.domain.decisions import refill_at_once_after
from batchgen.errors import ItemFailed
from batchgen.limits.backend import get_redis
from batchgen.limits.gate import Gate
from batchgen.registry import get_registry
from batchgen.store import db, items
from batchgen.store.items import Ticket
from batchgen.tasks.celery_app import celery_app
from batchgen.worker.cancellation import CancelWatcher
from batchgen.worker.dispatch import dispatch
from batchgen.worker.execution import run_item
from batchgen.worker.names import GENERATE_TASK
from batchgen.worker.refill import Refiller


@functools.cache
def _gate() -> Gate:
    return Gate(get_redis(), get_settings())


@functools.cache
def _watcher() -> CancelWatcher:
    return CancelWatcher(get_redis())


def _release(models: frozenset[str]) -> int:
    return dispatch(get_registry(), get_settings(), models)


def _refill_at_once_after(model: str) -> int:
    spec, settings = get_registry().get(model), get_settings()
    if spec is None:  # not in this registry: the coalescing wait only
        return sys.maxsize
    return refill_at_once_after(spec.max_concurrency, settings.dispatch_ahead_factor)


@functools.cache
def _refiller() -> Refiller:
    return Refiller(_release, get_settings().refill_coalesce_s, _refill_at_once_after)


# max_retries=None: a budget wait is not a failure and may repeat as often as
# needed; failure attempts are counted on the item in PostgreSQL instead. An item that
# failed for good ends its task FAILURE (ItemFailed: expected, logged without a trace).
# Request: a retry's ETA is on Redis's clock, read in this host's frame (worker/clock.py).
@celery_app.task(
    name=GENERATE_TASK,
    bind=True,
    ignore_result=True,
    max_retries=None,
    throws=(ItemFailed,),
    Request="batchgen.worker.clock:RedisClockRequest",
)
def generate(
    self: Task, item_id: int, model: str | None = None, ticket: dict[str, Any] | None = None
) -> str:
    """Run item ``item_id``. ``model`` routes the message to its group's queue;
    ``ticket`` lets the gate decide before the claim (a message without one, or with
    one this version cannot read, costs a lookup of the item)."""
    registry, settings = get_registry(), get_settings()
    read: Ticket | None = None
    if ticket is not None:
        with contextlib.suppress(ValueError):
            read = Ticket.from_message(item_id, ticket)
    verdict = run_item(
        item_id,
        registry,
        settings,
        _gate(),
        _watcher(),
        model=model,
        ticket=read,
    )
    if verdict.countdown_s is not None:
        raise self.retry(countdown=verdict.countdown_s)
    if verdict.frees_place and verdict.model is not None:
        # A place in the model's window freed: refill it soon, without waiting for the tick.
        _refiller().note(verdict.model)
    if verdict.outcome == "failed":
        with db.autocommit() as connection:
            code = items.error_code_of(connection, item_id)
        raise ItemFailed(f"item {item_id} failed: {code or 'failed'}")
    return verdict.outcome
