"""The provider interface: one call, a deadline, a cancellation signal."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.registry import ModelSpec


@dataclass(frozen=True)
class RateLimitState:
    """What the provider said about its limits on this answer (None: not reported)."""

    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests_s: float | None = None
    reset_tokens_s: float | None = None


@dataclass(frozen=True)
class ProviderRequest:
    """One chat request. ``body`` is the OpenAI-format request body from the batch line."""

    spec: ModelSpec
    body: dict[str, Any]
    timeout_s: float
    item_id: int | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    stream: bool = False


@dataclass(frozen=True)
class ProviderResponse:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    request_id: str | None
    # The answer in OpenAI chat.completion form, as the batch output file carries it.
    body: dict[str, Any]
    rate_limits: RateLimitState = RateLimitState()


class Provider(Protocol):
    def complete(self, request: ProviderRequest) -> ProviderResponse:
        """Make the call; raise a :class:`app.errors.ProviderError` subclass on failure."""
        ...
