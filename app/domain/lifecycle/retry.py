"""Retry timing, one pure function with named constants (after openai-python).

Transient failures back off exponentially with full jitter; a ``retry-after``
(or ``retry-after-ms``) from the provider is honoured up to a cap; no wait
ever passes the item's deadline.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Mapping
from enum import StrEnum
from typing import NamedTuple

INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 120.0


def parse_retry_after_s(headers: Mapping[str, str], now_s: float | None = None) -> float | None:
    """Seconds the provider asked us to wait, from ``retry-after-ms`` or ``retry-after``."""
    lower = {k.lower(): v for k, v in headers.items()}
    raw_ms = lower.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = lower.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    parsed = email.utils.parsedate_to_datetime(raw) if raw else None
    if parsed is None:
        return None
    return max(0.0, parsed.timestamp() - (now_s if now_s is not None else time.time()))


def backoff_s(
    attempt: int,
    *,
    retry_after_s: float | None = None,
    initial_s: float = INITIAL_BACKOFF_S,
    max_s: float = MAX_BACKOFF_S,
    rng: random.Random | None = None,
) -> float:
    """Wait before attempt ``attempt + 1`` (``attempt`` counts from 1).

    With a ``retry-after`` we wait that long, capped at ``MAX_RETRY_AFTER_S``
    (plus up to 10 % jitter so many workers told the same thing do not return
    together); otherwise full jitter over ``min(max_s, initial_s * 2**(attempt-1))``.
    """
    r = rng or random
    if retry_after_s is not None and retry_after_s >= 0:
        return min(retry_after_s, MAX_RETRY_AFTER_S) * (1.0 + 0.1 * r.random())
    ceiling = min(max_s, initial_s * (2 ** max(0, attempt - 1)))
    return r.uniform(0, ceiling)


def fits_deadline(wait_s: float, time_left_s: float, min_call_s: float = 1.0) -> bool:
    """True when waiting ``wait_s`` still leaves ``min_call_s`` for the call itself."""
    return wait_s + min_call_s <= time_left_s


class WaitAction(StrEnum):
    EXPIRE = "expire"  # end the item: no call can happen before its deadline
    REQUEUE = "requeue"  # stay queued; the task retries itself after the wait
    DEFER = "defer"  # back to pending; the dispatcher releases it after the wait


class WaitPlan(NamedTuple):
    action: WaitAction
    wait_s: float


def plan_wait(
    wait_s: float,
    time_left_s: float,
    *,
    firm: bool,
    releases_dispatch: bool,
    max_countdown_s: float,
    min_call_s: float = 1.0,
) -> WaitPlan:
    """What an item the gate denied does meanwhile.

    An item is expired early only when the wait is ``firm`` (tokens already
    reserved in the window cannot free sooner) and would pass its deadline. A
    wait that may end sooner (a provider cooldown, which a probe after it can
    end; a concurrency slot) never expires it: it comes back by its deadline at
    the latest, and is expired then if it still could not run. A wait on the
    item's own tenant gives its place in the dispatch window back (``DEFER``);
    so does any wait longer than a broker countdown should be.
    """
    if time_left_s <= 0:
        return WaitPlan(WaitAction.EXPIRE, 0.0)
    if firm and not fits_deadline(wait_s, time_left_s, min_call_s):
        return WaitPlan(WaitAction.EXPIRE, 0.0)
    wait = wait_s if firm else min(wait_s, time_left_s)
    if releases_dispatch or wait > max_countdown_s:
        return WaitPlan(WaitAction.DEFER, wait)
    return WaitPlan(WaitAction.REQUEUE, wait)
