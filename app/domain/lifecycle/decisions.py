"""What to do next, decided from plain values: after a failed call, and how many
items a model may have released.

The worker asks these functions and then does the I/O; they read no clock but
the times passed in, so every branch is testable without a server. The budget
wait's plan is :func:`batchgen.domain.lifecycle.retry.plan_wait`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from batchgen.domain.lifecycle import retry

T = TypeVar("T")


def window_size(max_concurrency: int, ahead_factor: float, pack_items: int = 1) -> int:
    """Items a model may have queued or running at once: ``ahead_factor`` times its
    concurrency in messages, each carrying ``pack_items`` items (:func:`pack_size`).
    A message's items run one after another, so every slot has a message to run only
    if the window grows with the pack; a pack holds about ``pack_target_s`` of calls,
    so the window's time ahead stays about the same."""
    return max(1, math.ceil(max_concurrency * ahead_factor)) * max(1, pack_items)


def refill_at_once_after(max_concurrency: int, ahead_factor: float, pack_items: int = 1) -> int:
    """Places a worker process may see freed in a model's window before it refills the
    model at once rather than at the end of its coalescing wait: half of what the window
    holds queued beyond the model's concurrency. Short calls use that reserve up within
    the wait; the wait would then cap the rate at about a window per wait."""
    reserve = window_size(max_concurrency, ahead_factor, pack_items) - max_concurrency
    return max(1, math.ceil(reserve / 2))


def pack_size(call_s: float | None, target_s: float, max_items: int) -> int:
    """How many of a model's items one message carries: as many as its recent calls
    (``call_s`` each, this process's average; None before the first) take
    ``target_s`` together, between 1 and ``max_items``. Celery's cost per message
    (read, events, ack) is then shared by the pack's items when calls are short, and a
    message of slow calls carries one item, as before: its cost is small beside the
    call, and its items are better spread over threads."""
    if call_s is None or max_items <= 1:
        return 1
    if call_s * max_items <= target_s:  # also a call time of zero (no division)
        return max_items
    return max(1, math.floor(target_s / call_s))


# A pack whose calls overlap holds as many of its model's slots as it has items: it
# carries at most this share of them, so that several packs, on several worker
# processes, share the model's slots.
OVERLAP_PACKS_PER_MODEL = 4


def short_calls(call_s: float | None, target_s: float) -> bool:
    """Whether a model's calls are short (at pace ``call_s``; None: not known yet): at
    least two of them fit in ``target_s`` one after another."""
    return call_s is not None and pack_size(call_s, target_s, 2) > 1


def short_pack_size(call_s: float, max_s: float, max_items: int) -> int:
    """How many items a pack of short calls carries, sized by count: as many as take
    half of ``max_s`` (the time after which a pack hands its untried items back) one
    after another at pace ``call_s``, at least 2, at most ``max_items``."""
    if call_s * max_items <= max_s / 2:  # also a call time of zero (no division)
        return max(1, max_items)
    return max(min(2, max_items), min(max_items, math.floor(max_s / 2 / call_s)))


def overlapping_pack_size(max_items: int, max_concurrency: int) -> int:
    """Items of a pack whose calls overlap, each holding a slot: at most a quarter of
    the model's ``max_concurrency`` and ``max_items``, at least one."""
    return max(1, min(max_items, max_concurrency // OVERLAP_PACKS_PER_MODEL))


def together_pack_size(
    call_s: float | None,
    target_s: float,
    max_items: int,
    max_concurrency: int,
    short_items: int | None = None,
    max_s: float | None = None,
) -> tuple[int, bool]:
    """How many of a model's items one message carries when a pack runs as a group
    (:mod:`batchgen.worker.pack_calls`), and whether its calls overlap. Calls that
    overlap each hold a slot: a pack of at most a quarter of the model's
    ``max_concurrency`` (at least 1) and ``max_items``, however slow the calls are.
    Short calls (:func:`short_calls`) run one after another (no thread switch, one slot
    at a time): as many as take ``target_s`` together (:func:`pack_size`), or, given
    ``short_items`` and ``max_s``, by count (:func:`short_pack_size`): Celery's cost
    per message and the refill's then fall on many items. Before the model's first call
    here, they overlap."""
    overlapping = overlapping_pack_size(max_items, max_concurrency)
    if call_s is not None and max_items > 1 and short_calls(call_s, target_s):
        if short_items is not None and max_s is not None:
            return short_pack_size(call_s, max_s, max(short_items, max_items)), False
        return pack_size(call_s, target_s, max_items), False
    return overlapping, overlapping > 1


def calls_overlap(call_s: float | None, target_s: float, items: int) -> bool:
    """Whether a pack of ``items`` run as a group overlaps its calls: unless they are
    short (:func:`short_calls`; None: not known yet)."""
    return items > 1 and not short_calls(call_s, target_s)


# A round of short calls takes at most this share of ``pack_max_s`` at the calls' pace:
# a pack whose calls turn slow stops between rounds, within a quarter of its time.
ROUND_SHARE_OF_MAX_S = 0.25


def round_size(call_s: float | None, max_s: float, max_items: int, short_items: int) -> int:
    """How many of a pack's short calls go through the gate, the claim, the record and
    the settlement together (a round): as many as take a quarter of ``max_s`` at pace
    ``call_s`` (:func:`pack_size`), so that a pack whose calls turn slow stops
    between rounds and hands the rest back (:func:`rounds_stop`); at most half of
    ``short_items`` (a round's items are claimed, marked sent, before its first call:
    a worker killed mid-round leaves that many for the sweep to ledger as maybe billed),
    at least ``max_items``, and 1 when ``max_items`` is 1 (packs off)."""
    if max_items <= 1:
        return 1
    return pack_size(call_s, max_s * ROUND_SHARE_OF_MAX_S, max(max_items, short_items // 2))


def rounds_stop(
    quickest_s: float | None,
    ran_s: float,
    target_s: float,
    max_s: float,
    lease_s: float,
    room_elsewhere: Callable[[], bool] = lambda: True,
) -> bool:
    """Whether a pack of short calls begins no more rounds, after one whose quickest
    answered call took ``quickest_s`` (None: none answered), having run ``ran_s``: once
    it has run ``max_s`` if its calls turned slow (even the quickest no longer short)
    and ``room_elsewhere()`` (asked only then) says other threads could run the rest's
    calls alongside, and in any case once it has run half of ``lease_s`` (its untried
    items' queued lease). A process busy with many threads makes a pack slow without
    its calls being so, and with every slot of the model held the rest would only wait
    for one elsewhere: neither alone hands anything back, which would only multiply the
    messages."""
    if ran_s >= lease_s / 2:
        return True
    turned_slow = quickest_s is None or not short_calls(quickest_s, target_s)
    return turned_slow and ran_s >= max_s and room_elsewhere()


# The share of the host's CPU time busy at or above which a slow pack keeps its rest
# (:func:`room_elsewhere`), as long as its quickest call took less than this share of
# ``max_s``: a call that slow is the provider's, whatever the host.
HOST_BUSY_SHARE = 0.9
STARVED_CALL_SHARE = 0.25


def room_elsewhere(
    host_busy_share: float | None,
    quickest_s: float | None,
    max_s: float,
    held: Callable[[], int],
    max_concurrency: int,
    max_items: int,
) -> bool:
    """Whether a pack's rest handed back would run alongside the calls of now. Not when
    the host's CPUs were all busy while the pack ran (``host_busy_share``; None: not
    known) and its quickest call (``quickest_s``) still took less than a quarter of
    ``max_s``: its calls were slow for want of a CPU, which more calls at once would
    only share. Otherwise when the model, with ``held()`` of its slots held (asked only
    then), has room for an overlapping pack's calls (:func:`room_for_overlap`)."""
    starved = (
        host_busy_share is not None
        and host_busy_share >= HOST_BUSY_SHARE
        and quickest_s is not None
        and quickest_s < max_s * STARVED_CALL_SHARE
    )
    if starved:
        return False
    return room_for_overlap(held(), max_concurrency, max_items)


def room_for_overlap(held: int, max_concurrency: int, max_items: int) -> bool:
    """Whether a model with ``held`` of its ``max_concurrency`` slots held has room for
    an overlapping pack's calls (:func:`together_pack_size`: at most a quarter of its
    slots, at most ``max_items``, at least one): a pack's rest handed back would then
    run alongside the calls of now, not after them."""
    return max_concurrency - held >= overlapping_pack_size(max_items, max_concurrency)


def split_into_packs(items: Sequence[T], size: int, alone: Callable[[T], bool]) -> list[list[T]]:
    """``items`` (in the order the messages should go out) as packs of at most ``size``
    consecutive items; an item for which ``alone`` holds (a synchronous call's: someone
    waits on it) travels in a message of its own, in its place."""
    packs: list[list[T]] = []
    current: list[T] = []
    for item in items:
        if alone(item):
            if current:
                packs.append(current)
                current = []
            packs.append([item])
            continue
        current.append(item)
        if len(current) >= max(1, size):
            packs.append(current)
            current = []
    if current:
        packs.append(current)
    return packs


def attempt_cap(model_max_attempts: int, global_max_attempts: int) -> int:
    """A model's attempt cap: its own, never above the global one."""
    return min(model_max_attempts, global_max_attempts)


class AfterRateLimit(StrEnum):
    REQUEUE = "wait"  # stay queued; the task retries itself after the wait
    DEFER = "deferred"  # back to pending with not_before; the dispatcher releases it
    FAIL = "failed"  # the item's 429 cap is used up
    EXPIRE = "expired"  # no time is left at all


@dataclass(frozen=True, kw_only=True)
class RateLimitDecision:
    action: AfterRateLimit
    wait_s: float = 0.0
    message: str = ""


def after_rate_limit(
    *,
    retry_after_s: float | None,
    rate_limited: int,
    max_rate_limited: int,
    time_left_s: float,
    max_countdown_s: float,
    default_wait_s: float = 1.0,
    rng: random.Random | None = None,
) -> RateLimitDecision:
    """The provider said 429: a budget signal, not a failure (no attempt is used).

    ``rate_limited`` counts this item's 429s, this one included; at
    ``max_rate_limited`` the item fails, so a limit set far above the provider's
    still ends. Otherwise it waits ``retry-after`` (capped, with jitter) like a
    budget wait: a short wait stays queued, a long one goes back to PostgreSQL.
    A 429 never expires an item early (a probe after the wait may pass): the
    wait is cut to what is left of the deadline, where the item expires at claim.
    """
    if rate_limited >= max_rate_limited:
        return RateLimitDecision(
            action=AfterRateLimit.FAIL,
            message=f"rate_limited: the provider refused the call {rate_limited} times",
        )
    asked_s = retry_after_s if retry_after_s is not None else default_wait_s
    wait_s = retry.backoff_s(1, retry_after_s=asked_s, rng=rng)
    plan = retry.plan_wait(
        wait_s,
        time_left_s,
        firm=False,
        releases_dispatch=False,
        max_countdown_s=max_countdown_s,
    )
    actions = {
        retry.WaitAction.DEFER: AfterRateLimit.DEFER,
        retry.WaitAction.REQUEUE: AfterRateLimit.REQUEUE,
        retry.WaitAction.EXPIRE: AfterRateLimit.EXPIRE,
    }
    message = "rate_limited: no time left to wait for the provider"
    return RateLimitDecision(
        action=actions[plan.action],
        wait_s=plan.wait_s,
        message=message if plan.action is retry.WaitAction.EXPIRE else "",
    )


class AfterFailure(StrEnum):
    RETRY = "retry"  # back to pending, through the dispatcher and the budget
    FAIL = "failed"
    EXPIRE = "expired"


@dataclass(frozen=True, kw_only=True)
class FailureDecision:
    action: AfterFailure
    code: str
    message: str
    wait_s: float = 0.0


def after_failure(
    *,
    kind: str,
    message: str,
    permanent: bool,
    attempt: int,
    max_attempts: int,
    retry_after_s: float | None,
    time_left_s: float,
    backoff_initial_s: float,
    backoff_max_s: float,
    rng: random.Random | None = None,
) -> FailureDecision:
    """A call failed: retry it inside the deadline and the attempt cap, else end it.

    A permanent error fails at once; the last attempt fails with the count; a
    retry whose wait (``retry_after_s`` honoured, else backoff with jitter) would
    pass the deadline expires the item.
    """
    text = f"{kind}: {message}"
    if permanent:
        return FailureDecision(action=AfterFailure.FAIL, code=kind, message=text)
    if attempt >= max_attempts:
        return FailureDecision(
            action=AfterFailure.FAIL, code=kind, message=f"{text} (after {attempt} attempts)"
        )
    wait_s = retry.backoff_s(
        attempt,
        retry_after_s=retry_after_s,
        initial_s=backoff_initial_s,
        max_s=backoff_max_s,
        rng=rng,
    )
    if not retry.fits_deadline(wait_s, time_left_s):
        return FailureDecision(
            action=AfterFailure.EXPIRE, code="expired", message=f"{text}; no time left to retry"
        )
    return FailureDecision(action=AfterFailure.RETRY, code=kind, message=text, wait_s=wait_s)
