"""What to do next, decided from plain values: after a failed call, and how many
items a model may have released.

The worker asks these functions and then does the I/O; they read no clock but
the times passed in, so every branch is testable without a server. The budget
wait's plan is :func:`batchgen.domain.retry.plan_wait`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import StrEnum

from batchgen.domain import retry


def window_size(max_concurrency: int, ahead_factor: float) -> int:
    """Items a model may have queued or running at once."""
    return max(1, math.ceil(max_concurrency * ahead_factor))


def refill_at_once_after(max_concurrency: int, ahead_factor: float) -> int:
    """Places a worker process may see freed in a model's window before it refills the
    model at once rather than at the end of its coalescing wait: half of what the window
    holds queued beyond the model's concurrency. Short calls use that reserve up within
    the wait; the wait would then cap the rate at about a window per wait."""
    reserve = window_size(max_concurrency, ahead_factor) - max_concurrency
    return max(1, math.ceil(reserve / 2))


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
