"""How to settle a call's token reservation once the call is over, pure.

After a provider call, the reservation made for it (``prompt + max_tokens``
tokens and one request, see :mod:`batchgen.limits.budget`) is either

* **reconciled** to what the provider charged when it answered (and the
  rate-limit headers of the answer are heard),
* **released** in full when the provider cannot have counted the call (a 429,
  whose rate-limit headers are heard too; a flex call refused as "resource
  unavailable", with no cooldown: it says nothing of the limits; a call cancelled
  before it was sent, a request rejected before generating, a connect failure), or
* **kept** as it is when the provider may have counted it (a transient error
  after the request was sent, a call cancelled mid-answer): it ages out of the
  window by itself.

:func:`decide_settlement` makes that decision; :meth:`batchgen.limits.gate.Gate.settle`
carries it out on Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from batchgen.errors import (
    CallCancelled,
    FlexUnavailable,
    PermanentProviderError,
    ProviderError,
    RateLimited,
)
from batchgen.registry import ChargePolicy

# How long a 429 without a (usable) retry-after closes the budget.
DEFAULT_COOLDOWN_S = 1.0


class SettleAction(StrEnum):
    """What becomes of the call's reservation."""

    RECONCILE = "reconcile"  # set it to the tokens the provider charged
    RELEASE = "release"  # give it back whole: the provider counted nothing
    KEEP = "keep"  # leave it on the books: the provider may have counted it


class SettleCounter(StrEnum):
    """The per-model event counters a settlement adds one to."""

    COOLDOWNS = "cooldowns"
    RATE_LIMITED = "rate_limited"
    TRANSIENT_ERRORS = "transient_errors"
    PERMANENT_ERRORS = "permanent_errors"


@dataclass(frozen=True, slots=True)
class Settlement:
    """The decision, in the order it is carried out: the reservation's fate, then the
    rate-limit headers, then the cooldown, then the counters."""

    action: SettleAction
    # RECONCILE: the tokens to set the reservation to; None otherwise.
    charged_tokens: int | None = None
    # Hear the rate-limit headers: an answer's, or a 429's when it carried any.
    observe_rate_limits: bool = False
    # Close the model's budget for this long (after a 429); None: no cooldown.
    cooldown_s: float | None = None
    counters: tuple[SettleCounter, ...] = ()


def charged_rest(policy: ChargePolicy, completion_tokens: int, max_tokens: int) -> int:
    """The part of what the provider counts that is not the prompt."""
    if policy is ChargePolicy.RESERVE:
        return max_tokens  # OpenAI keeps max_tokens charged
    return completion_tokens  # Anthropic counts the real output


def charged_tokens(
    policy: ChargePolicy, prompt_tokens: int, completion_tokens: int, max_tokens: int
) -> int:
    """What the provider counts against its limit once it has answered."""
    return prompt_tokens + charged_rest(policy, completion_tokens, max_tokens)


def decide_settlement(
    *,
    charge_policy: ChargePolicy,
    max_tokens: int,
    answered: bool,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    error: ProviderError | None = None,
) -> Settlement:
    """Settle a call that ``answered`` (with the usage the provider reported) or failed
    with ``error``. An answer wins over an error; a call with neither is settled like a
    transient failure (the reservation is kept)."""
    if answered:
        charged = charged_tokens(charge_policy, prompt_tokens, completion_tokens, max_tokens)
        return Settlement(SettleAction.RECONCILE, charged_tokens=charged, observe_rate_limits=True)
    if isinstance(error, FlexUnavailable):
        # The flex tier was busy: nothing was charged, and the account's limits are not
        # full (no cooldown: standard calls and other flex calls may go on).
        return Settlement(SettleAction.RELEASE)
    if isinstance(error, RateLimited):
        # Not admitted by the provider: nothing was charged, but it is full (and its
        # headers, when it sent any, say how full).
        return Settlement(
            SettleAction.RELEASE,
            observe_rate_limits=error.rate_limits is not None,
            cooldown_s=error.retry_after_s or DEFAULT_COOLDOWN_S,
            counters=(SettleCounter.COOLDOWNS, SettleCounter.RATE_LIMITED),
        )
    if isinstance(error, CallCancelled):
        # Unbilled: nothing reached the provider. Billed: it may charge what it
        # generated, so the reservation stays (and no error is counted).
        return Settlement(SettleAction.KEEP if error.billed else SettleAction.RELEASE)
    if isinstance(error, PermanentProviderError):
        # Rejected before generating.
        return Settlement(SettleAction.RELEASE, counters=(SettleCounter.PERMANENT_ERRORS,))
    if error is not None and not error.billed and error.status is None:
        # Connect failure: nothing was sent, nothing was counted.
        return Settlement(SettleAction.RELEASE, counters=(SettleCounter.TRANSIENT_ERRORS,))
    # Transient: the provider may have counted it; keep the reservation.
    return Settlement(SettleAction.KEEP, counters=(SettleCounter.TRANSIENT_ERRORS,))
