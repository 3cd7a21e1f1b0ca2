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


def attempt_cap(model_max_attempts: int, global_max_attempts: int) -> int:
    """A model's attempt cap: its own, never above the global one."""
    return min(model_max_attempts, global_max_attempts)


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
