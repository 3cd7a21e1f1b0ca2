"""Fault injection: which (if any) fault a request gets. Pure apart from a seeded RNG.

Kinds: ``"5xx"`` (500/503, or 500/529 on the Anthropic API), ``"hang"`` (sleep
``hang_s`` then answer), ``"reset"`` (abort the connection; mid-stream for a
streaming request), ``"malformed"`` (200 with a body that is not valid JSON),
``"429"`` (a spurious rate-limit answer), ``"status:NNN[:code]"`` (any 4xx/5xx
status with the API's error body and an optional error code, e.g.
``status:403`` or ``status:400:context_length_exceeded``; a ``status:429``
carries ``retry-after: 2``, the seconds form only). The header
``x-sim-fault`` forces a kind for one request, whatever ``fault_rate`` is;
``x-sim-fault: none`` forces no fault.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from batchgen.simulator.formats import context_length_message, error_body
from batchgen.simulator.sim_config import FAULT_KINDS, is_fault_kind, parse_status_fault

STATUS_FAULT_RETRY_AFTER_S = 2
# Error codes (OpenAI) a status fault carries when the header names none.
_OPENAI_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


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
            if not is_fault_kind(override):
                raise ValueError(
                    f"unknown x-sim-fault {override!r}; known: {FAULT_KINDS} or status:NNN[:code]"
                )
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


def status_fault_answer(
    api: str, kind: str, prompt_tokens: int, context_window: int | None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``(status, body, extra headers)`` of a ``"status:NNN[:code]"`` fault."""
    parsed = parse_status_fault(kind)
    if parsed is None:
        raise ValueError(f"not a status fault: {kind!r}")
    status, code = parsed
    headers = {"retry-after": str(STATUS_FAULT_RETRY_AFTER_S)} if status == 429 else {}
    if code == "context_length_exceeded":
        window = context_window or max(1, prompt_tokens - 1)
        message = context_length_message(api, window, prompt_tokens)
    else:
        message = f"Simulated HTTP {status}" + (f" ({code})." if code else ".")
    if api in ("gemini", "bedrock"):
        return status, error_body(api, status, message, code=code), headers
    if api == "anthropic":
        kind_name = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else None)
        return (
            status,
            error_body(api, status, message, kind=kind_name or "invalid_request_error"),
            headers,
        )
    code = code or _OPENAI_CODES.get(status)
    kind_name = "server_error" if status >= 500 else "invalid_request_error"
    if status == 429:
        kind_name = "requests"
    return status, error_body(api, status, message, kind=kind_name, code=code), headers
