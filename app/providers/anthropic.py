"""Anthropic adapter on the official ``anthropic`` SDK (Messages API).

Batch lines are in OpenAI chat format; this adapter translates them to a
Messages request and translates the answer back, so the results file has
one format whatever the provider.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import anthropic

from app.errors import MalformedResponse, ProviderError, TransientProviderError
from app.providers.base import ProviderRequest, ProviderResponse
from app.providers.headers import anthropic_rate_limits
from app.providers.openai import ITEM_HEADER, classify_status

FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}
PASSED_THROUGH = ("temperature", "top_p", "metadata")


@functools.cache
def _client(base_url: str, api_key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=base_url,
        api_key=api_key,
        max_retries=0,
    )


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def to_messages_request(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """An OpenAI chat body as Anthropic Messages parameters (pure)."""
    system = [_text(m.get("content")) for m in body["messages"] if m.get("role") == "system"]
    messages = [
        {"role": m["role"], "content": _text(m.get("content"))}
        for m in body["messages"]
        if m.get("role") in ("user", "assistant")
    ]
    params: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
    if system:
        params["system"] = "\n\n".join(system)
    stop = body.get("stop")
    if stop:
        params["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    for key in PASSED_THROUGH:
        if key in body:
            params[key] = body[key]
    return params


def translate(exc: Exception) -> ProviderError:
    if isinstance(exc, anthropic.APIStatusError):
        code = None
        if isinstance(exc.body, dict) and isinstance(exc.body.get("error"), dict):
            code = exc.body["error"].get("type")
        message = f"HTTP {exc.status_code}"
        return classify_status(exc.status_code, message, exc.response.headers, code)
    if isinstance(exc, anthropic.APITimeoutError):
        return TransientProviderError("timeout")
    if isinstance(exc, anthropic.APIConnectionError):
        return TransientProviderError(f"connection error: {type(exc.__cause__).__name__}")
    if isinstance(exc, anthropic.APIResponseValidationError | ValueError):
        return MalformedResponse(f"malformed response: {type(exc).__name__}")
    return TransientProviderError(f"unexpected {type(exc).__name__}")


class AnthropicProvider:
    def complete(self, request: ProviderRequest) -> ProviderResponse:
        spec = request.spec
        body = request.body
        max_tokens = (
            body.get("max_completion_tokens") or body.get("max_tokens") or (spec.max_output_tokens)
        )
        headers = {ITEM_HEADER: str(request.item_id)} if request.item_id is not None else {}
        client = _client(spec.base_url, spec.api_key())
        try:
            raw = client.messages.with_raw_response.create(
                model=spec.name,
                **to_messages_request(body, max_tokens),
                extra_headers=headers,
                timeout=request.timeout_s,
            )
            message = raw.parse()
        except anthropic.AnthropicError as exc:
            raise translate(exc) from None
        except ValueError as exc:
            raise translate(exc) from None
        text = "".join(getattr(b, "text", "") for b in message.content)
        finish = FINISH_REASONS.get(message.stop_reason or "", message.stop_reason)
        usage = message.usage
        return ProviderResponse(
            text=text,
            prompt_tokens=usage.input_tokens,
            completion_tokens=usage.output_tokens,
            finish_reason=finish,
            request_id=raw.headers.get("request-id") or message.id,
            body={
                "id": message.id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": message.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                    }
                ],
                "usage": {
                    "prompt_tokens": usage.input_tokens,
                    "completion_tokens": usage.output_tokens,
                    "total_tokens": usage.input_tokens + usage.output_tokens,
                },
            },
            rate_limits=anthropic_rate_limits(raw.headers),
        )
