"""Anthropic adapter on the official ``anthropic`` SDK (Messages API, plain or streaming).

Batch lines are in OpenAI chat format; this adapter translates them to a
Messages request and translates the answer back, so the results file has
one format whatever the provider.

The SDK raises raw ``json.JSONDecodeError`` for an unreadable body and raw
``httpx2`` errors (``RemoteProtocolError``, ``ReadTimeout``) when a stream is
cut or stalls; both are mapped here like the SDK's own exceptions.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import anthropic
import httpx2
import pydantic

from batchgen.errors import MalformedResponse, ProviderError
from batchgen.providers.base import (
    ProviderRequest,
    ProviderResponse,
    StreamWatch,
    cancelled_before_call,
    chat_params,
    classify_status,
    safe_code,
    status_message,
    transport_error,
)
from batchgen.providers.headers import anthropic_rate_limits
from batchgen.registry import ModelSpec

FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
PASSED_THROUGH = ("metadata",)
# Sampling fields the SDK (2.x) has no keyword for: sent in the body as they are,
# through the SDK's extra_body (a provider that refuses one answers a 400).
SAMPLING_FIELDS = ("temperature", "top_p")
# Error types of an ``event: error`` inside a 200 stream, as the HTTP status they stand for.
ERROR_TYPE_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
_MALFORMED = (json.JSONDecodeError, UnicodeDecodeError, pydantic.ValidationError)
_SDK_ERRORS = (anthropic.AnthropicError, httpx2.HTTPError, *_MALFORMED)


@functools.cache
def sdk_client(base_url: str, api_key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)


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
    sampling = {key: body[key] for key in SAMPLING_FIELDS if key in body}
    if sampling:
        params["extra_body"] = sampling
    return params


def translate(exc: BaseException, *, in_stream: bool = False) -> ProviderError:
    """Map an SDK, raw ``httpx2`` or decoding exception to the project's error tree (no text)."""
    if isinstance(exc, anthropic.APIStatusError):
        error = exc.body.get("error") if isinstance(exc.body, dict) else None
        error = error if isinstance(error, dict) else {}
        code = safe_code(exc.error_code) or safe_code(error.get("type"))
        status = exc.status_code
        billed = False
        if status < 400:  # an error event inside a 200 stream
            status, billed = ERROR_TYPE_STATUS.get(error.get("type") or "", 500), True
        provider_message = error.get("message")
        return classify_status(
            status,
            status_message(status, exc, code, exc.response.headers.get("request-id")),
            exc.response.headers,
            code,
            provider_message=provider_message if isinstance(provider_message, str) else None,
            billed=billed,
        )
    if isinstance(exc, (anthropic.APIResponseValidationError, httpx2.DecodingError, *_MALFORMED)):
        return MalformedResponse(f"malformed response ({type(exc).__name__})", billed=True)
    # APIConnectionError (and APITimeoutError), raw httpx2 transport errors.
    return transport_error(exc, in_stream=in_stream)


def _max_tokens(request: ProviderRequest) -> int:
    body = request.body
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(value or request.spec.max_output_tokens)


def _params(request: ProviderRequest) -> dict[str, Any]:
    """The body as Messages parameters (:func:`to_messages_request`) with the call's own."""
    return chat_params(request, to_messages_request(request.body, _max_tokens(request)))


def finish_reason(stop_reason: str | None) -> str | None:
    return FINISH_REASONS.get(stop_reason or "", stop_reason)


def cache_usage(usage: Any) -> dict[str, Any]:
    """Anthropic's prompt-cache counts of ``usage`` as usage keys of the OpenAI form
    (``prompt_tokens_details.cached_tokens``) beside Anthropic's own, which the ledger
    prices (:func:`batchgen.domain.cost.usage_of`); empty when the cache was not used."""
    read = getattr(usage, "cache_read_input_tokens", None) or 0
    written = getattr(usage, "cache_creation_input_tokens", None) or 0
    if not (read or written):
        return {}
    return {
        "prompt_tokens_details": {"cached_tokens": read},
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": written,
    }


def chat_completion(
    message_id: str,
    model: str,
    text: str,
    finish: str | None,
    prompt: int,
    completion: int,
    cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The answer in OpenAI ``chat.completion`` form (pure); ``cache``: :func:`cache_usage`."""
    return {
        "id": message_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            **(cache or {}),
        },
    }


def input_tokens(usage: Any) -> int:
    """All input tokens: uncached plus cache writes and reads (``None`` counts 0)."""
    return sum(
        getattr(usage, name, None) or 0
        for name in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    )


class AnthropicProvider:
    """The Messages API (plain or streaming) behind the OpenAI-shaped interface."""

    def warm(self, spec: ModelSpec) -> None:
        client = sdk_client(spec.base_url, spec.api_key())
        client.default_headers  # noqa: B018  (the SDK works out its platform headers once)

    def complete(self, request: ProviderRequest) -> ProviderResponse:
        cancelled_before_call(request)
        client = sdk_client(request.spec.base_url, request.spec.api_key())
        params = _params(request)
        try:
            if request.stream:
                return self._stream(client, request, params)
            return self._plain(client, params)
        except ProviderError:
            raise
        except _SDK_ERRORS as exc:  # before any answer: the connect may have failed
            raise translate(exc) from None

    def _plain(self, client: anthropic.Anthropic, params: dict[str, Any]) -> ProviderResponse:
        raw = client.messages.with_raw_response.create(**params)
        message = raw.parse()
        try:
            text = "".join(getattr(b, "text", "") for b in message.content)
            prompt, done = input_tokens(message.usage), message.usage.output_tokens
            finish = finish_reason(message.stop_reason)
        except (AttributeError, TypeError) as exc:
            raise MalformedResponse(
                f"answer without content or usage ({type(exc).__name__})",
                status=raw.status_code,
                billed=True,
            ) from None
        return ProviderResponse(
            text=text,
            prompt_tokens=prompt,
            completion_tokens=done,
            finish_reason=finish,
            request_id=raw.headers.get("request-id") or message.id,
            body=chat_completion(
                message.id, message.model, text, finish, prompt, done, cache_usage(message.usage)
            ),
            rate_limits=anthropic_rate_limits(raw.headers),
        )

    def _stream(
        self, client: anthropic.Anthropic, request: ProviderRequest, params: dict[str, Any]
    ) -> ProviderResponse:
        watch = StreamWatch(request)
        stream = client.messages.create(**params, stream=True)
        headers = stream.response.headers
        limits = anthropic_rate_limits(headers)  # as of now, the start of the stream
        message_id = model = stop_reason = None
        output_tokens: int | None = None
        cache: dict[str, Any] = {}
        stopped = False
        try:
            watch.check()
            for event in stream:
                if event.type == "message_start":
                    message_id, model = event.message.id, event.message.model
                    watch.prompt_tokens = input_tokens(event.message.usage)
                    cache = cache_usage(event.message.usage)
                elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                    watch.add(event.delta.text)
                elif event.type == "message_delta":
                    stop_reason = event.delta.stop_reason or stop_reason
                    output_tokens = event.usage.output_tokens
                    if event.usage.input_tokens is not None:
                        watch.prompt_tokens = input_tokens(event.usage)
                elif event.type == "message_stop":
                    stopped = True
                watch.check()
        except _SDK_ERRORS as exc:  # the answer had started: it may be billed
            raise translate(exc, in_stream=True) from None
        finally:
            stream.close()
        if message_id is None or output_tokens is None or not stopped:
            raise MalformedResponse("stream ended before message_stop", status=200, billed=True)
        text, finish = watch.text, finish_reason(stop_reason)
        prompt = watch.prompt_tokens or 0
        return ProviderResponse(
            text=text,
            prompt_tokens=prompt,
            completion_tokens=output_tokens,
            finish_reason=finish,
            request_id=headers.get("request-id") or message_id,
            body=chat_completion(
                message_id, model or request.spec.name, text, finish, prompt, output_tokens, cache
            ),
            rate_limits=limits,
        )
