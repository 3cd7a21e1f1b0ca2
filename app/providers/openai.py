"""OpenAI-compatible adapter on the official ``openai`` SDK (any ``base_url``).

SDK retries are off: retry timing belongs to :mod:`app.retry` and the
dispatcher, which also honour the item's deadline.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import openai

from app.errors import (
    ContextLengthExceeded,
    MalformedResponse,
    PermanentProviderError,
    ProviderError,
    RateLimited,
    TransientProviderError,
)
from app.providers.base import ProviderRequest, ProviderResponse
from app.providers.headers import openai_rate_limits
from app.retry import parse_retry_after_s

ITEM_HEADER = "x-batchgen-item"
TRANSIENT_STATUSES = frozenset({408, 409})


@functools.cache
def _client(base_url: str, api_key: str) -> openai.OpenAI:
    # One client (one connection pool) per endpoint and process; thread-safe.
    return openai.OpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=0,
    )


def classify_status(status: int, message: str, headers: Any, code: str | None) -> ProviderError:
    """Map an HTTP error answer to the project's error tree."""
    if status == 429:
        return RateLimited(message, retry_after_s=parse_retry_after_s(dict(headers or {})))
    if status in TRANSIENT_STATUSES or status >= 500:
        return TransientProviderError(message, status=status)
    if code == "context_length_exceeded" or "context length" in message.lower():
        return ContextLengthExceeded(message, status=status)
    return PermanentProviderError(message, status=status)


def _error_code(exc: openai.APIStatusError) -> str | None:
    body = exc.body
    if isinstance(body, dict):
        code = body.get("code")
        if code is None and isinstance(body.get("error"), dict):
            code = body["error"].get("code")
        return code if isinstance(code, str) else None
    return None


def translate(exc: Exception) -> ProviderError:
    """Map an SDK exception to the project's error tree (message has no prompt text)."""
    if isinstance(exc, openai.APIStatusError):
        return classify_status(
            exc.status_code, f"HTTP {exc.status_code}", exc.response.headers, _error_code(exc)
        )
    if isinstance(exc, openai.APITimeoutError):
        return TransientProviderError("timeout")
    if isinstance(exc, openai.APIConnectionError):
        return TransientProviderError(f"connection error: {type(exc.__cause__).__name__}")
    if isinstance(exc, openai.APIResponseValidationError | json.JSONDecodeError | ValueError):
        return MalformedResponse(f"malformed response: {type(exc).__name__}")
    return TransientProviderError(f"unexpected {type(exc).__name__}")


class OpenAIProvider:
    """Chat completions against any OpenAI-compatible server."""

    def complete(self, request: ProviderRequest) -> ProviderResponse:
        spec = request.spec
        body = dict(request.body)
        body["model"] = spec.name
        messages = body.pop("messages")
        body.pop("model")
        headers = {ITEM_HEADER: str(request.item_id)} if request.item_id is not None else {}
        client = _client(spec.base_url, spec.api_key())
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=spec.name,
                messages=messages,
                extra_body=body or None,
                extra_headers=headers,
                timeout=request.timeout_s,
            )
            completion = raw.parse()
        except openai.OpenAIError as exc:
            raise translate(exc) from None
        except (json.JSONDecodeError, ValueError) as exc:
            raise translate(exc) from None
        if not completion.choices or completion.usage is None:
            raise MalformedResponse("answer without choices or usage", status=raw.status_code)
        choice = completion.choices[0]
        return ProviderResponse(
            text=choice.message.content or "",
            prompt_tokens=completion.usage.prompt_tokens,
            completion_tokens=completion.usage.completion_tokens,
            finish_reason=choice.finish_reason,
            request_id=raw.headers.get("x-request-id") or completion.id,
            body=completion.model_dump(mode="json", exclude_none=True),
            rate_limits=openai_rate_limits(raw.headers),
        )
