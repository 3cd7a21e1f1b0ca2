"""What a provider said about its rate limits on one answer (pure data).

Filled in by the provider adapters (:mod:`batchgen.providers.headers` parses
the headers) and read by the token budget (:mod:`batchgen.limits.budget`);
neither of those has to import the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


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

    def age_s(self, now_monotonic_s: float | None = None) -> float:
        """Seconds since the headers were received (``now_monotonic_s``: default the clock)."""
        if self.received_s is None:
            return 0.0
        now = time.monotonic() if now_monotonic_s is None else now_monotonic_s
        return max(0.0, now - self.received_s)
