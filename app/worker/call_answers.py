"""A synchronous call's caller, waiting: for its whole answer, or for its stream's
chunks as they arrive.

The call runs in this process (:mod:`batchgen.worker.call_runner`), or, after this
process lost it (its run stopped on an error, a dispatcher took a retry), on a
worker. The item's end is heard from PostgreSQL (``LISTEN``) and read back; while
it waits, the caller's presence is renewed in Redis, and a caller gone, a deadline
passed or Redis lost cancels the call (no provider call starts after that; one
under way stops at its next chunk).

A streamed call's chunks come through its relay (:mod:`batchgen.worker.relay`) when
this process makes the provider call; a call a worker ran instead has no chunks here:
its caller gets the whole answer of record, replayed, at its end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator
from typing import Any, NamedTuple, NoReturn

from batchgen.config import get_settings
from batchgen.domain.formats import call_rules
from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.errors import CallFailed
from batchgen.limits import liveness
from batchgen.limits.backend import get_redis
from batchgen.store import call_rows
from batchgen.store.call_rows import CallWaiter
from batchgen.store.db import session_scope
from batchgen.worker.call_runner import (
    PendingCall,
    call_waiter,
    caller_waits,
    cancel_call,
    redis_unavailable,
)
from batchgen.worker.cancellation import cancel_batch
from batchgen.worker.relay import End

Presence = Callable[[], bool]


def _connected() -> bool:
    return True


def wait_call(pending: PendingCall, still_there: Presence = _connected) -> call_rows.CallOutcome:
    """Wait for a call's end; its answer, or :class:`CallFailed` (the deadline passed,
    the item failed, or the caller went away: then the call is cancelled)."""
    settings = get_settings()
    item_id = pending.stored.item_id
    # The item's own deadline ends it (the sweep expires it); a little longer here.
    until = pending.deadline_mono_s + settings.worker.sweep_interval_s + 1.0
    renewed_mono_s = time.monotonic()
    try:
        for _ in CallWaiter.wait_ticks(pending.woken, until, settings.calls.poll_s, first=True):
            if time.monotonic() - renewed_mono_s >= settings.calls.caller_lease_s / 3:
                renewed_mono_s = time.monotonic()
                caller_waits(item_id, settings.calls.caller_lease_s)
            ended = _ended(pending, still_there)
            if ended is not None:
                return ended
        cancel_call(pending)
        raise call_rules.call_error("expired", "the call's deadline passed")
    finally:
        _forget(pending)


def _ended(pending: PendingCall, still_there: Presence) -> call_rows.CallOutcome | None:
    """The call's answer once it ended; None while it runs. Raises the error it ended
    with, or that stops the wait: the caller gone (the call is cancelled), Redis lost.
    While this process runs it, its end comes from the run (the answer in hand, or the
    run's end, after which the item is read)."""
    if pending.answer:
        return call_rows.CallOutcome(ItemStatus.SUCCEEDED, pending.answer[0], None, None)
    if pending.running_here():
        ended = None
    else:
        with session_scope() as session:
            ended = call_rows.outcome(session, pending.stored.item_id)
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
    call_waiter().forget(pending.stored.item_id, pending.woken)
    if pending.stored.replayed:
        return  # the presence is the first caller's, who may still be waiting
    if pending.answer:
        return  # the run that answered dropped it (batchgen.worker.call_runner._call_ended)
    with contextlib.suppress(Exception):  # the key expires by itself
        liveness.drop_caller(get_redis(), pending.stored.item_id)


class StreamPart(NamedTuple):
    """A piece of a streamed call's answer: a provider ``chunk`` as it came, or the
    ``whole`` answer of record (no chunk of it came through this process)."""

    chunk: dict[str, Any] | None = None
    whole: dict[str, Any] | None = None


def stream_call(
    pending: PendingCall, still_there: Presence = _connected
) -> Generator[StreamPart, None, None]:
    """A streamed call's answer as it comes: its chunks, in order, as the provider sent
    them, ending once the answer is recorded; or, when none came here, the whole answer
    at its end. Raises :class:`CallFailed` as :func:`wait_call` does, and also after
    chunks when the answer cannot be finished (the attempt failed, the caller went
    away, the deadline passed): the call is then cancelled. Closing the iterator
    before its end (the caller hung up) cancels the call too."""
    relay = pending.relay
    if relay is None:
        raise ValueError("the call was not started as a stream")
    settings = get_settings()
    item_id = pending.stored.item_id
    until = pending.deadline_mono_s + settings.worker.sweep_interval_s + 1.0
    renewed_mono_s = time.monotonic()
    relayed = 0
    try:
        while True:
            now = time.monotonic()
            if now >= until:
                cancel_call(pending)
                raise call_rules.call_error("expired", "the call's deadline passed")
            if now - renewed_mono_s >= settings.calls.caller_lease_s / 3:
                renewed_mono_s = now
                caller_waits(item_id, settings.calls.caller_lease_s)
            got = relay.take(min(settings.calls.poll_s, until - now))
            if isinstance(got, dict):
                relayed += 1
                yield StreamPart(chunk=got)
            elif relayed:  # the answer under way ends with its attempt, here
                if isinstance(got, End):
                    _end_of_relayed(pending, got, relayed)
                    return
            elif not relay.produced:  # nothing streamed here (yet): did the call end?
                ended = _ended(pending, still_there)
                if ended is not None and not relay.produced:
                    yield StreamPart(whole=ended.response)
                    return
                continue  # (if it was streamed here after all, its chunks are queued)
            if not still_there():
                _caller_gone(pending)
    except GeneratorExit:  # closed before its end: the caller went away
        with contextlib.suppress(Exception):
            cancel_call(pending)
        raise
    finally:
        _forget(pending)


def _end_of_relayed(pending: PendingCall, end: End, relayed: int) -> None:
    """The attempt whose chunks the caller has ended: done when its answer was recorded;
    otherwise the answer cannot be finished, and the call is cancelled."""
    if end.outcome == "succeeded":
        return
    with contextlib.suppress(Exception):  # it may have ended already
        cancel_call(pending)
    code = end.outcome if end.outcome in ("expired", "cancelled") else "upstream_error"
    raise call_rules.call_error(
        code, f"the provider's answer broke off after {relayed} chunks ({end.outcome or 'lost'})"
    )
