"""Anthropic adapter on the official ``anthropic`` SDK (Messages API, plain or streaming).

Batch lines are in OpenAI chat format; this adapter translates them to a
Messages request and translates the answer back, so the results file has
one format whatever the provider. A line made from a Messages request (Anthropic's
API or Message Batches: its ``body.anthropic_params``) is sent as the caller wrote
it, every parameter unchanged but the model (the registry's name), and its answer
is the ``Message`` JSON as the provider returned it (a stream's events merged into
it: :class:`batchgen.domain.formats.answers.AnthropicMerge`).

The SDK raises raw ``json.JSONDecodeError`` for an unreadable body and raw
``httpx2`` errors (``RemoteProtocolError``, ``ReadTimeout``) when a stream is
cut or stalls; both are mapped here like the SDK's own exceptions.

A streamed call goes on the lean path (:mod:`batchgen.providers.lean_http`) where that path
applies: the body and headers the SDK would send, its events read as the provider's
JSON (no model object per event), an error status or an ``event: error`` raised as
the SDK's own error. Otherwise, and with ``BATCHGEN_LEAN_HTTP=false``, the SDK's.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anthropic
import httpx2
import pydantic

from batchgen import json_codec
from batchgen.domain.formats.answers import AnthropicMerge
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS
from batchgen.domain.formats.message_batches import NATIVE_PARAMS
from batchgen.domain.formats.prompt_cache import with_cache_breakpoint
from batchgen.errors import MalformedResponse, PermanentProviderError, ProviderError
from batchgen.providers import lean_http
from batchgen.providers.base import (
    ProviderRequest,
    ProviderResponse,
    StreamWatch,
    cancelled_before_call,
    chat_params,
    classify_status,
    safe_code,
    sse_events,
    status_message,
    transport_error,
    unsendable,
    unusable_client,
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
_SDK_ERRORS: tuple[type[BaseException], ...] = (
    anthropic.AnthropicError,
    httpx2.HTTPError,
    *lean_http.transport_errors,
    *_MALFORMED,
)
# The Messages API's route under the client's base URL, as the SDK posts it.
MESSAGES_ROUTE = "/v1/messages"
# chat_params' keys that are the SDK call's options, not fields of the request's body.
_CALL_OPTIONS = ("extra_headers", "extra_query", "extra_body", "timeout")


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
    if isinstance(exc, anthropic.AnthropicError) and not isinstance(exc, anthropic.APIError):
        return unusable_client(exc)  # the SDK's own configuration check: nothing was sent
    local = None if in_stream else unsendable(exc)
    if local is not None:
        return local
    # APIConnectionError (and APITimeoutError), raw httpx2 transport errors.
    return transport_error(exc, in_stream=in_stream)


def _max_tokens(request: ProviderRequest) -> int:
    body = request.body
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(value or request.spec.output_cap)


# Messages parameters batchgen sets itself on a native request.
_OWN_NATIVE = ("model", "stream")


def native_params(request: ProviderRequest) -> dict[str, Any] | None:
    """A Messages request's own parameters as the SDK call's arguments (all but the
    model and ``stream`` in ``extra_body``, so each reaches the provider unchanged),
    or None when the line was not made from one."""
    native = request.body.get(NATIVE_PARAMS)
    if not isinstance(native, dict):
        return None
    if request.cache_prefix:
        native = with_cache_breakpoint(native)
    extra = {k: v for k, v in native.items() if k not in (*_OWN_NATIVE, "messages", "max_tokens")}
    fields = {
        "messages": native["messages"],
        "max_tokens": native.get("max_tokens") or _max_tokens(request),
        "extra_body": extra or None,
    }
    return chat_params(request, fields)


def _params(request: ProviderRequest) -> dict[str, Any]:
    """The body as Messages parameters (:func:`to_messages_request`) with the call's own;
    a prefix shared with other items (``request.cache_prefix``) marked for the
    provider's cache where the request marks none."""
    native = native_params(request)
    if native is not None:
        return native
    params = to_messages_request(request.body, _max_tokens(request))
    if request.cache_prefix:
        params = with_cache_breakpoint(params)
    return chat_params(request, params)


def finish_reason(stop_reason: str | None) -> str | None:
    return FINISH_REASONS.get(stop_reason or "", stop_reason)


def cache_usage(usage: Any) -> dict[str, Any]:
    """Anthropic's prompt-cache counts of ``usage`` as usage keys of the OpenAI form
    (``prompt_tokens_details.cached_tokens``) beside Anthropic's own, which the ledger
    prices (:func:`batchgen.domain.billing.cost.usage_of`); empty when the cache was not used."""
    read = _count(usage, "cache_read_input_tokens")
    written = _count(usage, "cache_creation_input_tokens")
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


class ChatChunks:
    """A Messages stream's events as the ``chat.completion.chunk`` objects of the answer
    an OpenAI-format line gets (:func:`chat_completion`): the role, each text delta, the
    finish reason, then the usage (pure)."""

    def __init__(self, model: str, created: int) -> None:
        self.created = created
        self.head: dict[str, Any] = {"id": "", "object": "chat.completion.chunk", "model": model}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {**self.head, "created": self.created, "choices": [choice]}

    def of(self, event: dict[str, Any], prompt: int, cache: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks ``event`` makes (``prompt``: the input tokens so far; ``cache``:
        :func:`cache_usage` of the stream's start)."""
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self.head["id"] = message.get("id") or ""
            self.head["model"] = message.get("model") or self.head["model"]
            return [self._chunk({"role": "assistant", "content": ""})]
        delta = event.get("delta") or {}
        if kind == "content_block_delta" and delta.get("type") == "text_delta":
            return [self._chunk({"content": delta.get("text") or ""})]
        if kind == "message_delta":
            done = int((event.get("usage") or {}).get("output_tokens") or 0)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": done,
                "total_tokens": prompt + done,
                **cache,
            }
            last = {**self.head, "created": self.created, "choices": [], "usage": usage}
            return [self._chunk({}, finish_reason(delta.get("stop_reason"))), last]
        return []


def _count(usage: Any, name: str) -> int:
    """A count of ``usage`` (the SDK's object, or the provider's JSON); missing or None: 0."""
    value = usage.get(name) if isinstance(usage, Mapping) else getattr(usage, name, None)
    return int(value or 0)


def input_tokens(usage: Any) -> int:
    """All input tokens: uncached plus cache writes and reads (``None`` counts 0)."""
    return sum(
        _count(usage, name)
        for name in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    )


def stream_body(params: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body the SDK sends for ``messages.create(**params, stream=True)``: the
    parameters as they are, ``stream``, and ``extra_body`` merged in."""
    body = {k: v for k, v in params.items() if k not in _CALL_OPTIONS}
    body["stream"] = True
    body.update(params.get("extra_body") or {})
    return body


def _lean_events(client: anthropic.Anthropic, response: lean_http.LeanResponse) -> Iterator[Any]:
    """The stream's events as the provider's JSON, as the SDK reads them: ``ping`` and
    unnamed events skipped, an ``error`` event raised as the SDK's status error."""
    for name, data in sse_events(response.iter_bytes()):
        if name is None or name == b"ping":
            continue
        if name == b"error":
            body: Any
            try:
                body = json.loads(data)
                message = f"{body}"
            except ValueError:
                body = data.decode("utf-8", "replace")
                message = body or f"Error code: {response.status_code}"
            answer = httpx2.Response(
                response.status_code,
                headers=list(response.headers.items()),
                request=response.request,
            )
            raise client._make_status_error(message, body=body, response=answer)
        if data:
            yield json_codec.loads(data)


class AnthropicProvider:
    """The Messages API (plain or streaming) behind the OpenAI-shaped interface."""

    def warm(self, spec: ModelSpec) -> None:
        client = sdk_client(spec.base_url, spec.api_key())
        client.default_headers  # noqa: B018  (the SDK works out its platform headers once)
        lean = lean_http.endpoint(client, True)
        if lean is not None:
            lean.warm()

    def complete(self, request: ProviderRequest) -> ProviderResponse:
        cancelled_before_call(request)
        if request.endpoint != CHAT_COMPLETIONS:  # the registry lets no such request in
            raise PermanentProviderError(f"an anthropic model does not serve {request.endpoint}")
        client = sdk_client(request.spec.base_url, request.spec.api_key())
        params = _params(request)
        try:
            if request.stream:
                return self._stream(client, request, params)
            return self._plain(client, params, native=NATIVE_PARAMS in request.body)
        except ProviderError:
            raise
        except _SDK_ERRORS as exc:  # before any answer: the connect may have failed
            raise translate(exc) from None

    def _plain(
        self, client: anthropic.Anthropic, params: dict[str, Any], *, native: bool
    ) -> ProviderResponse:
        raw = client.messages.with_raw_response.create(**params)
        message = raw.parse()
        try:
            text = "".join(getattr(b, "text", "") for b in message.content)
            prompt, done = input_tokens(message.usage), message.usage.output_tokens
            finish = finish_reason(message.stop_reason)
            body = json.loads(raw.http_response.text) if native else None
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
            body=body
            or chat_completion(
                message.id, message.model, text, finish, prompt, done, cache_usage(message.usage)
            ),
            rate_limits=anthropic_rate_limits(raw.headers),
        )

    @staticmethod
    def _open_stream(
        client: anthropic.Anthropic, request: ProviderRequest, params: dict[str, Any]
    ) -> tuple[Mapping[str, str], Iterator[Any], Callable[[], None]]:
        """The streamed call up to its status line and headers: its headers, its events
        (each the provider's JSON) and how to close it; on the lean path where it
        applies, else through the SDK."""
        lean = lean_http.endpoint(client, request.lean_http)
        if lean is not None:
            body = stream_body(params)
            response = lean.post_stream(MESSAGES_ROUTE, body, request.headers(), request.timeout_s)
            return response.headers, _lean_events(client, response), response.close
        stream = client.messages.create(**params, stream=True)
        events = (event.model_dump(mode="json", exclude_unset=True) for event in stream)
        return stream.response.headers, events, stream.close

    def _stream(
        self, client: anthropic.Anthropic, request: ProviderRequest, params: dict[str, Any]
    ) -> ProviderResponse:
        watch = StreamWatch(request)
        native = NATIVE_PARAMS in request.body
        relay = request.on_chunk
        # A line in OpenAI form is answered as a chat completion: so are its chunks.
        chat = ChatChunks(request.spec.name, int(time.time())) if not native else None
        headers, events, close = self._open_stream(client, request, params)
        merge = AnthropicMerge()
        cache: dict[str, Any] = {}
        try:
            limits = anthropic_rate_limits(headers)  # as of now, the start of the stream
            watch.check()
            for data in events:
                merge.add(data)
                kind = data["type"]
                if kind == "message_start":
                    usage = data["message"]["usage"]
                    watch.prompt_tokens = input_tokens(usage)
                    cache = cache_usage(usage)
                elif kind == "content_block_delta" and data["delta"]["type"] == "text_delta":
                    watch.add(data["delta"]["text"])
                elif kind == "message_delta" and data["usage"].get("input_tokens") is not None:
                    watch.prompt_tokens = input_tokens(data["usage"])
                if relay is not None and chat is None:
                    relay(data)
                elif relay is not None and chat is not None:
                    for chunk in chat.of(data, watch.prompt_tokens or 0, cache):
                        relay(chunk)
                watch.check()
        except _SDK_ERRORS as exc:  # the answer had started: it may be billed
            raise translate(exc, in_stream=True) from None
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise MalformedResponse(
                f"malformed stream event ({type(exc).__name__})", status=200, billed=True
            ) from None
        finally:
            close()
        message = merge.result()
        usage = (message or {}).get("usage") or {}
        if message is None or usage.get("output_tokens") is None or not merge.stopped:
            raise MalformedResponse("stream ended before message_stop", status=200, billed=True)
        message_id, model = message.get("id") or "", message.get("model") or request.spec.name
        text, finish = merge.text(), finish_reason(message.get("stop_reason"))
        prompt, output_tokens = watch.prompt_tokens or 0, int(usage["output_tokens"])
        if chat is None:
            body = message
        else:
            body = chat_completion(message_id, model, text, finish, prompt, output_tokens, cache)
            body["created"] = chat.created  # as its chunks said
        return ProviderResponse(
            text=text,
            prompt_tokens=prompt,
            completion_tokens=output_tokens,
            finish_reason=finish,
            request_id=headers.get("request-id") or message_id,
            body=body,
            rate_limits=limits,
        )
