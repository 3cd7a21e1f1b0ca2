"""Reference copy of limits/lua/budget_reserve.lua's and budget_settle.lua's budget maths.

What a provider said about its rate limits on one answer (pure data), and the
pure maths of a budget that matches the provider's limiter.

Filled in by the provider adapters (:mod:`batchgen.providers.headers` parses
the headers) and read by the token budget (:mod:`batchgen.limits.budget`);
neither of those has to import the other.

The functions below are the budget's arithmetic, for both limit shapes
(:class:`batchgen.registry.LimitShape`); the Lua scripts in
``app/limits/lua/`` compute the same on Redis, and the tests hold the two to
each other.

**Token bucket.** A bucket of ``capacity`` (the limit) refills at ``rate =
capacity / window_s`` per second up to its capacity (:func:`bucket_level`); a
reservation of ``n`` is granted iff the level is at least ``n`` plus the claims
held ahead of it plus a margin of ``min(rate * guard_s, capacity - n)``
(:func:`bucket_margin`: the bucket's counterpart of the window's guard, for
what the provider counts above our estimate; it costs at most ``guard_s`` of
the first burst, nothing in the steady state) and takes ``n`` out; a denied one
waits ``(n + held + margin - level) / rate`` (:func:`bucket_wait_s`). Over any
interval of ``d`` seconds the bucket grants at most ``capacity + rate * d``.

**Calibration** (:func:`calibrated_level`). A header saying the provider had
``remaining`` tokens right after it admitted (or refused) the call we granted
at ``anchor`` puts our level at::

    min(capacity, remaining + rate * (now - anchor)) - granted_since

where ``granted_since`` is what we granted after ``anchor`` (the provider had
not seen it yet). This lowers our level when the provider has less than we
believe and raises it when it has more.

**Learned ratio** (:func:`ratio_update`). Providers count a prompt their own
way (OpenAI's limiter: about four bytes a token; Anthropic: its own
tokenizer), so a reservation's prompt part is ``ceil(ratio * prompt_tokens_est)``
(:func:`scaled_prompt_tokens`), with one ``ratio`` per model, learned as an
exponentially weighted mean of samples::

    ratio <- clamp(ratio + weight * (clamp(sample) - ratio))

The first sample is taken whole (``ratio <- clamp(sample)``); until then reservations
use ``budget_ratio_start`` (the settings; 1.3).

clamped to ``[ratio_min, ratio_max]``. A sample is, in the bucket shape with
token headers, what the provider consumed between two headers over what we
estimated for the calls granted in between (:func:`interval_ratio_sample`)::

    sample = (remaining_1 + rate * (t_2 - t_1) - remaining_2 - rest) / prompt_est

(``rest``: the non-prompt part of those calls, e.g. ``max_tokens``;
``prompt_est``: the sum of their ``prompt_tokens_est``), taken only when the
provider's bucket cannot have been full in between and at least a few calls
were granted; otherwise (window shape, or no token headers) the answer's
usage: ``sample = usage.prompt_tokens / prompt_tokens_est``
(:func:`usage_ratio_sample`). With ``weight = 0.3`` a provider counting 26 %
more than tiktoken is within 2 % of its count after 8 samples
(``0.26 * 0.7 ** 8 = 0.015``).

**The limiter's shape** (:func:`shape_evidence`, :func:`next_shape`). A model
whose registry entry sets no ``limit_shape`` starts as a bucket (OpenAI's and
Anthropic's documented limiters) and learns its provider's shape from the reset
headers (``x-ratelimit-reset-*``, ``anthropic-ratelimit-*-reset``: the time
until the limiter is back to full). In a bucket of ``limit`` refilled over
``window_s`` that time is proportional to what is used::

    reset_s = window_s * (limit - remaining) / limit

In a window it is the time until the window's charges age out: right after a
call, about a whole window (sliding), or wherever the window ends (fixed),
whatever is used. A header whose reset is the bucket's, within
``SHAPE_RESET_SLACK_S`` plus ``SHAPE_RESET_SLACK`` of it, is a bucket's (if a
window just charged would not read the same: the bucket's reset is then well
below ``window_s``); one off by more is a window's. ``budget_shape_samples``
such samples in a row against the shape the budget keeps switch it (one odd
header never does).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

# The ratio of a provider that counts as tiktoken does (the tests' reference point;
# reservations before a model's first sample use the budget_ratio_start setting).
RATIO_START = 1.0
# A usage sample of a prompt below this many estimated tokens says more about the
# message framing than about the tokenizer: not learned from.
USAGE_SAMPLE_MIN_TOKENS = 32
# Float slack of the level comparison (Lua and Python compute in doubles).
EPSILON = 1e-9
# How far a reset header may be from a bucket's and still be a bucket's: the header's
# rounding (Anthropic's reset is a time to the whole second; OpenAI's "1.23s"), the
# clocks' skew, plus a share of the reset itself (the provider's own refill steps).
SHAPE_RESET_SLACK_S = 2.0
SHAPE_RESET_SLACK = 0.15


@dataclass(frozen=True)
class RateLimitState:
    """What the provider said about its limits on this answer (None: not reported)."""

    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests_s: float | None = None
    reset_tokens_s: float | None = None
    # time.monotonic() when the headers were received (a stream's headers arrive at
    # its start, long before the call ends); None: just now.
    received_s: float | None = None

    # The provider's limits as it reported them (x-ratelimit-limit-*,
    # anthropic-ratelimit-*-limit), None: not reported.
    limit_requests: int | None = None
    limit_tokens: int | None = None

    def age_s(self, now_monotonic_s: float | None = None) -> float:
        """Seconds since the headers were received (``now_monotonic_s``: default the clock)."""
        if self.received_s is None:
            return 0.0
        now = time.monotonic() if now_monotonic_s is None else now_monotonic_s
        return max(0.0, now - self.received_s)

    @property
    def reported(self) -> bool:
        """The answer said how much of a limit is left (tokens or requests)."""
        return self.remaining_tokens is not None or self.remaining_requests is not None


# --- the token bucket ---------------------------------------------------------------------


def bucket_level(
    level: float | None, last_s: float | None, now_s: float, capacity: float, rate: float
) -> float:
    """The level at ``now_s`` of a bucket that held ``level`` at ``last_s``: refilled
    at ``rate`` per second, never above ``capacity``. A bucket never seen is full; a
    clock that went back refills nothing."""
    if level is None:
        return float(capacity)
    if last_s is not None and now_s > last_s:
        level += rate * (now_s - last_s)
    return min(float(capacity), level)


def bucket_wait_s(level: float, need: float, rate: float) -> float:
    """Seconds until a bucket at ``level`` refilling at ``rate`` holds ``need``
    (0 when it does)."""
    return max(0.0, (need - level) / rate)


def bucket_margin(capacity: float, rate: float, guard_s: float, tokens: float) -> float:
    """The refill a bucket keeps in hand beside a request of ``tokens``: ``guard_s``
    of it (what the provider may count above our estimate, calls still on their way),
    at most what fits beside the request, so a full bucket grants up to its capacity."""
    return min(rate * guard_s, max(0.0, capacity - tokens))


def bucket_grants(level: float, tokens: float, held: float = 0.0, margin: float = 0.0) -> bool:
    """Whether a bucket at ``level`` grants ``tokens`` with ``held`` claimed ahead and
    ``margin`` kept in hand."""
    return level - held - margin >= tokens - EPSILON


def calibrated_level(
    remaining: float, since_anchor_s: float, capacity: float, rate: float, granted_since: float
) -> float:
    """Our level now, from a header: the provider had ``remaining`` right after our
    call granted ``since_anchor_s`` ago, and we granted ``granted_since`` after it.
    May be below zero (we owe the provider): the bucket then refills from there."""
    return min(float(capacity), remaining + rate * max(0.0, since_anchor_s)) - granted_since


# --- the window --------------------------------------------------------------------------


def window_observation(limit: int, used: int, remaining: int) -> int:
    """Window shape: the tokens to charge as an observation (positive: the provider
    has less than the ``limit - used`` we believe), or the observation tokens to take
    back (negative: it has more; only observations can be taken back, never a
    reservation)."""
    return limit - used - remaining


# --- the learned ratio ---------------------------------------------------------------------


def scaled_prompt_tokens(prompt_tokens_est: int, ratio: float) -> int:
    """A reservation's prompt part in the provider's count: ``ceil(ratio * est)``."""
    if prompt_tokens_est <= 0:
        return 0
    return max(0, math.ceil(ratio * prompt_tokens_est - EPSILON))


def clamp(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


def ratio_update(
    ratio: float | None, sample: float, weight: float, low: float, high: float
) -> float | None:
    """One step of the exponentially weighted ratio (see the module docstring); ``ratio``
    None (no sample yet): the first sample, clamped, becomes the ratio."""
    if not math.isfinite(sample):
        return ratio
    if ratio is None:
        return clamp(sample, low, high)
    return clamp(ratio + weight * (clamp(sample, low, high) - ratio), low, high)


def interval_ratio_sample(
    *,
    start_remaining: float,
    end_remaining: float,
    elapsed_s: float,
    capacity: float,
    rate: float,
    rest_tokens: float,
    prompt_est: float,
    calls: int,
    min_calls: int,
) -> float | None:
    """Bucket shape: the provider's prompt count over ours for the calls granted
    between two headers (``elapsed_s`` apart), or None when the interval says
    nothing: too few calls (boundary noise would dominate), no prompt, or a bucket
    that may have been full meanwhile (its refill was then cut, so the consumption
    is unknown)."""
    if calls < min_calls or prompt_est <= 0 or elapsed_s <= 0:
        return None
    if start_remaining + rate * elapsed_s >= capacity:
        return None
    consumed = start_remaining + rate * elapsed_s - end_remaining
    return (consumed - rest_tokens) / prompt_est


def usage_ratio_sample(usage_prompt_tokens: int, prompt_tokens_est: int) -> float | None:
    """The provider's reported prompt tokens over our estimate (None for tiny prompts)."""
    if prompt_tokens_est < USAGE_SAMPLE_MIN_TOKENS or usage_prompt_tokens <= 0:
        return None
    return usage_prompt_tokens / prompt_tokens_est


# --- the limiter's shape ----------------------------------------------------------------

WINDOW = "window"
BUCKET = "bucket"


def bucket_reset_s(limit: float, remaining: float, window_s: float) -> float:
    """Seconds until a bucket of ``limit`` refilled over ``window_s`` that holds
    ``remaining`` is full again."""
    return window_s * max(0.0, limit - remaining) / limit


def reset_evidence(
    limit: int | None, remaining: int | None, reset_s: float | None, window_s: float
) -> str | None:
    """What one limiter's header says of its shape: ``"bucket"`` (its reset is a
    bucket's, and a window just charged would not read the same), ``"window"`` (its
    reset is not a bucket's) or None (it says nothing: a part missing, or a bucket
    and a window would read alike)."""
    if limit is None or remaining is None or reset_s is None or limit <= 0 or window_s <= 0:
        return None
    if not math.isfinite(reset_s) or reset_s < 0:
        return None
    expected = bucket_reset_s(limit, min(remaining, limit), window_s)
    slack = SHAPE_RESET_SLACK_S + SHAPE_RESET_SLACK * expected
    if abs(reset_s - expected) > slack:
        return WINDOW
    # A sliding window just charged reads about a whole window: only a bucket's reset
    # clearly below it tells the two apart.
    return BUCKET if window_s - reset_s > slack else None


def shape_evidence(state: RateLimitState | None, window_s: float) -> str | None:
    """What an answer's headers say of the provider's limiter (see the module
    docstring): the tokens' header, or the requests' when that says nothing."""
    if state is None:
        return None
    tokens = reset_evidence(
        state.limit_tokens, state.remaining_tokens, state.reset_tokens_s, window_s
    )
    if tokens is not None:
        return tokens
    return reset_evidence(
        state.limit_requests, state.remaining_requests, state.reset_requests_s, window_s
    )


def next_shape(
    current: str, against: int, evidence: str | None, switch_after: int
) -> tuple[str, int]:
    """The learned shape after one header: ``(shape, samples against it in a row)``.
    A sample for the shape kept resets the count; ``switch_after`` in a row against it
    switch it (``budget_settle.lua`` does the same on Redis)."""
    if evidence is None or evidence not in (WINDOW, BUCKET):
        return current, against
    if evidence == current:
        return current, 0
    against += 1
    if against >= max(1, switch_after):
        return evidence, 0
    return current, against
