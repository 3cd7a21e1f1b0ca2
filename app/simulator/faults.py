"""Fault injection: which (if any) fault a request gets. Pure apart from a seeded RNG.

Kinds: ``"5xx"`` (500/503, or 500/529 on the Anthropic API), ``"hang"`` (sleep
``hang_s`` then answer), ``"reset"`` (abort the connection; mid-stream for a
streaming request), ``"malformed"`` (200 with a body that is not valid JSON),
``"429"`` (a spurious rate-limit answer). The header ``x-sim-fault`` forces a
kind for one request, whatever ``fault_rate`` is; ``x-sim-fault: none``
forces no fault.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from app.simulator.config import FAULT_KINDS


class FaultInjector:
    """Draws faults with probability ``rate`` among ``kinds`` from ``random.Random(seed)``."""

    def __init__(self, rate: float, kinds: Sequence[str], seed: int | None = None) -> None:
        self.rate = rate
        self.kinds = tuple(kinds)
        self.rng = random.Random(seed)

    def choose(self, override: str | None = None) -> str | None:
        """The fault for the next request, or ``None``.

        ``override`` (the ``x-sim-fault`` header) wins: a kind, or ``"none"``.
        Raises ``ValueError`` for an unknown override.
        """
        if override is not None:
            override = override.strip().lower()
            if override in ("", "none"):
                return None
            if override not in FAULT_KINDS:
                raise ValueError(f"unknown x-sim-fault {override!r}; known: {FAULT_KINDS}")
            return override
        if self.rate <= 0 or not self.kinds:
            return None
        if self.rng.random() < self.rate:
            return self.rng.choice(self.kinds)
        return None

    def server_error_status(self, api: str) -> int:
        """Status code of a ``"5xx"`` fault: 500 or 503 (OpenAI), 500 or 529 (Anthropic)."""
        other = 529 if api == "anthropic" else 503
        return 500 if self.rng.random() < 0.5 else other

    def jitter_ms(self, max_ms: float) -> float:
        """Uniform latency jitter in ``[0, max_ms]``."""
        return self.rng.uniform(0.0, max_ms) if max_ms > 0 else 0.0
