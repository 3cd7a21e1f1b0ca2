"""A synchronous call's caller, waiting for its answer.

The call runs in this process (:mod:`batchgen.worker.calls`), or, after this
process lost it (its run stopped on an error, a dispatcher took a retry), on a
worker. The item's end is heard from PostgreSQL (``LISTEN``) and read back; while
it waits, the caller's presence is renewed in Redis, and a caller gone, a deadline
passed or Redis lost cancels the call (no provider call starts after that; one
under way stops at its next chunk).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import NoReturn

from batchgen.config import get_settings
from batchgen.domain import calls as call_rules
from batchgen.domain.status import ItemStatus
from batchgen.errors import CallFailed
from batchgen.limits import liveness
from batchgen.limits.backend import get_redis
from batchgen.store import calls
from batchgen.store.calls import CallWaiter
from batchgen.store.db import session_scope
from batchgen.worker.calls import (
    PendingCall,
    call_waiter,
    caller_waits,
    cancel_call,
    redis_unavailable,
)
from batchgen.worker.cancellation import cancel_batch

Presence = Callable[[], bool]


def _connected() -> bool:
    return True


def wait_call(pending: PendingCall, still_there: Presence = _connected) -> calls.CallOutcome:
    """Wait for a call's end; its answer, or :class:`CallFailed` (the deadline passed,
    the item failed, or the caller went away: then the call is cancelled)."""
    settings = get_settings()
    item_id = pending.stored.item_id
    # The item's own deadline ends it (the sweep expires it); a little longer here.
    until = pending.deadline_mono_s + settings.sweep_interval_s + 1.0
    renewed_mono_s = time.monotonic()
    try:
        for _ in CallWaiter.wait_ticks(pending.woken, until, settings.call_poll_s, first=True):
            if time.monotonic() - renewed_mono_s >= settings.caller_lease_s / 3:
                renewed_mono_s = time.monotonic()
                caller_waits(item_id, settings.caller_lease_s)
            ended = _ended(pending, still_there)
            if ended is not None:
                return ended
        cancel_call(pending)
        raise call_rules.call_error("expired", "the call's deadline passed")
    finally:
        _forget(pending)


def _ended(pending: PendingCall, still_there: Presence) -> calls.CallOutcome | None:
    """The call's answer once it ended; None while it runs. Raises the error it ended
    with, or that stops the wait: the caller gone (the call is cancelled), Redis lost."""
    with session_scope() as session:
        ended = calls.outcome(session, pending.stored.item_id)
    if ended is not None:
        if ended.status is ItemStatus.SUCCEEDED and ended.response is not None:
            return ended
        raise call_rules.call_error(ended.error_code, ended.error_message)
    if not still_there():
        _caller_gone(pending)
    if pending.failures:  # Redis went away: nothing here can pass the gate
        with contextlib.suppress(Exception):
            cancel_batch(pending.stored.batch_id, pending.tenant)
        raise redis_unavailable()
    return None


def _caller_gone(pending: PendingCall) -> NoReturn:
    cancel_call(pending)
    raise CallFailed(499, "client_closed", "the caller went away; call cancelled")


def _forget(pending: PendingCall) -> None:
    call_waiter().forget(pending.stored.item_id)
    with contextlib.suppress(Exception):  # the key expires by itself
        liveness.drop_caller(get_redis(), pending.stored.item_id)
