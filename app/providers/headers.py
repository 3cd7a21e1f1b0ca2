"""Parsing providers' rate-limit headers (pure)."""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Mapping

from batchgen.domain.lifecycle.deadlines import host_now
from batchgen.domain.scheduling.rate_limits import RateLimitState

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_openai_duration_s(text: str | None) -> float | None:
    """OpenAI's reset format: ``"1s"``, ``"6m0s"``, ``"120ms"``, ``"1h2m3.5s"``."""
    if not text:
        return None
    parts = _PART.findall(text.strip())
    if not parts:
        try:
            return float(text)
        except ValueError:
            return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def openai_rate_limits(
    headers: Mapping[str, str], received_s: float | None = None
) -> RateLimitState:
    """``received_s``: ``time.monotonic()`` when the headers arrived (default: now)."""
    h = _lower(headers)
    return RateLimitState(
        remaining_requests=_int(h.get("x-ratelimit-remaining-requests")),
        remaining_tokens=_int(h.get("x-ratelimit-remaining-tokens")),
        reset_requests_s=parse_openai_duration_s(h.get("x-ratelimit-reset-requests")),
        reset_tokens_s=parse_openai_duration_s(h.get("x-ratelimit-reset-tokens")),
        limit_requests=_int(h.get("x-ratelimit-limit-requests")),
        limit_tokens=_int(h.get("x-ratelimit-limit-tokens")),
        received_s=time.monotonic() if received_s is None else received_s,
    )


def rate_limits_of(
    headers: Mapping[str, str] | None, received_s: float | None = None
) -> RateLimitState | None:
    """The rate-limit state of any answer (a 429 too), whichever API's headers it
    carries: Anthropic's ``anthropic-ratelimit-*`` or OpenAI's ``x-ratelimit-*``.
    None when it carries neither."""
    if not headers:
        return None
    names = {k.lower() for k in headers}
    if any(n.startswith("anthropic-ratelimit-") for n in names):
        return anthropic_rate_limits(headers, received_s=received_s)
    if any(n.startswith("x-ratelimit-") for n in names):
        return openai_rate_limits(headers, received_s=received_s)
    return None


def _rfc3339_in_s(text: str | None, now: dt.datetime) -> float | None:
    if not text:
        return None
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return max(0.0, (when - now).total_seconds())


def anthropic_rate_limits(
    headers: Mapping[str, str], now: dt.datetime | None = None, received_s: float | None = None
) -> RateLimitState:
    """``received_s``: ``time.monotonic()`` when the headers arrived (default: now)."""
    h = _lower(headers)
    now = now or host_now()  # the reset times are on the provider's clock
    return RateLimitState(
        remaining_requests=_int(h.get("anthropic-ratelimit-requests-remaining")),
        remaining_tokens=_int(h.get("anthropic-ratelimit-tokens-remaining")),
        reset_requests_s=_rfc3339_in_s(h.get("anthropic-ratelimit-requests-reset"), now),
        reset_tokens_s=_rfc3339_in_s(h.get("anthropic-ratelimit-tokens-reset"), now),
        limit_requests=_int(h.get("anthropic-ratelimit-requests-limit")),
        limit_tokens=_int(h.get("anthropic-ratelimit-tokens-limit")),
        received_s=time.monotonic() if received_s is None else received_s,
    )
