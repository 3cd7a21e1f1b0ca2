"""Wire formats of the two APIs: request parsing, bodies, errors, rate-limit headers."""

from __future__ import annotations

import datetime as dt
import json
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from batchgen.simulator.limits import Admission
from batchgen.simulator.text import anthropic_prompt_messages


class BadRequest(Exception):
    """A request the API rejects with 400 (``code`` e.g. ``context_length_exceeded``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class ChatRequest:
    """The parts of a chat request the simulator uses (same for both APIs)."""

    model: str
    prompt_messages: list[Mapping[str, Any]]
    max_tokens: int
    stream: bool
    include_usage: bool
    # The whole body (tools, n, logprobs, cache_control...: simulator.rich reads it).
    body: Mapping[str, Any] = field(default_factory=dict)


def go_duration(seconds: float) -> str:
    """OpenAI's reset format (Go durations): ``"120ms"``, ``"1s"``, ``"1.5s"``, ``"6m0s"``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    ms = math.ceil(seconds * 1000)
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return out + f"{secs}s"


def rfc3339_in(seconds: float) -> str:
    """The UTC RFC 3339 time ``seconds`` from now (Anthropic's reset format)."""
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=max(0.0, seconds))
    return moment.replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def _require_messages(body: Mapping[str, Any], roles: frozenset[str]) -> list[Mapping[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        if message["role"] not in roles:
            raise BadRequest(
                f"messages[{i}].role {message['role']!r} is not one of {sorted(roles)}",
                f"messages[{i}].role",
            )
        content = message.get("content")
        if not (content is None or isinstance(content, str | list)):
            raise BadRequest(
                f"messages[{i}].content must be a string or an array", f"messages[{i}].content"
            )
    return messages


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required", param="model")
    return model


def _positive_int(value: Any, name: str) -> int:
    if type(value) is not int or value < 1:
        raise BadRequest(f"'{name}' must be an integer >= 1", param=name)
    return value


def _stream_flag(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    return stream


OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
ANTHROPIC_ROLES = frozenset({"user", "assistant"})


def parse_openai(body: Any, default_max_tokens: int) -> ChatRequest:
    """Validate an OpenAI chat.completions body; raise :class:`BadRequest`."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    model = _model(body)
    messages = _require_messages(body, OPENAI_ROLES)
    raw = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = default_max_tokens if raw is None else _positive_int(raw, name)
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    return ChatRequest(
        model,
        messages,
        max_tokens,
        _stream_flag(body),
        bool(options.get("include_usage", False)),
        body,
    )


def parse_anthropic(body: Any) -> ChatRequest:
    """Validate an Anthropic messages body; raise :class:`BadRequest`."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    model = _model(body)
    messages = _require_messages(body, ANTHROPIC_ROLES)
    max_tokens = _positive_int(body.get("max_tokens"), "max_tokens")
    system = body.get("system")
    if not (system is None or isinstance(system, str | list)):
        raise BadRequest("'system' must be a string or an array of text blocks", "system")
    return ChatRequest(
        model,
        anthropic_prompt_messages(system, messages),
        max_tokens,
        _stream_flag(body),
        True,
        body,
    )


def new_id(api: str) -> str:
    """A fresh response id: ``chatcmpl-...`` (OpenAI) or ``msg_...`` (Anthropic)."""
    return ("msg_" if api == "anthropic" else "chatcmpl-") + secrets.token_hex(12)


def error_body(
    api: str,
    status: int,
    message: str,
    *,
    kind: str | None = None,
    code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """An error body in the API's format; ``kind`` overrides the default error type."""
    if api in ("gemini", "bedrock"):
        from batchgen.simulator import native_errors as native

        return native.error_body(api, status, message, code)
    if api == "anthropic":
        default = {
            400: "invalid_request_error",
            429: "rate_limit_error",
            529: "overloaded_error",
        }.get(status, "api_error")
        return {"type": "error", "error": {"type": kind or default, "message": message}}
    default = {400: "invalid_request_error", 429: "requests"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind or default, "param": param, "code": code}}


def ratelimit_headers(
    api: str,
    requests: tuple[int | None, Admission] | None,
    tokens: tuple[int | None, Admission] | None,
) -> dict[str, str]:
    """Rate-limit headers from the limiters' last decisions (``(limit, admission)``).

    A limiter with limit ``None`` (unlimited) contributes no headers.
    """
    out: dict[str, str] = {}
    if api in ("gemini", "bedrock"):  # neither API sends rate-limit headers
        return out
    for what, pair in (("requests", requests), ("tokens", tokens)):
        if pair is None or pair[0] is None:
            continue
        limit, adm = pair
        if api == "anthropic":
            out[f"anthropic-ratelimit-{what}-limit"] = str(limit)
            out[f"anthropic-ratelimit-{what}-remaining"] = str(adm.remaining)
            out[f"anthropic-ratelimit-{what}-reset"] = rfc3339_in(adm.reset_s)
        else:
            out[f"x-ratelimit-limit-{what}"] = str(limit)
            out[f"x-ratelimit-remaining-{what}"] = str(adm.remaining)
            out[f"x-ratelimit-reset-{what}"] = go_duration(adm.reset_s)
    return out


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """``retry-after`` (whole seconds, rounded up) and ``retry-after-ms``."""
    return {
        "retry-after": str(max(1, math.ceil(retry_after_s))),
        "retry-after-ms": str(max(1, math.ceil(retry_after_s * 1000))),
    }


def openai_completion(
    rid: str, model: str, text: str, finish: str, prompt: int, completion: int
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def openai_chunk(
    rid: str, model: str, delta: dict[str, Any], finish: str | None, include_usage: bool
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with a single choice."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def openai_delta_events(rid: str, model: str, include_usage: bool) -> Callable[[str], bytes]:
    """``piece -> sse("openai", "", openai_chunk(rid, model, {"content": piece}, None,
    include_usage))``, rendered from one template (a stream's chunks differ only in
    their text): the same bytes, without encoding the whole chunk for every piece."""
    marker = "\x00piece\x00"
    chunk = openai_chunk(rid, model, {"content": marker}, None, include_usage)
    head, tail = sse("openai", "", chunk).decode().split(json.dumps(marker))

    def render(piece: str) -> bytes:
        return (head + json.dumps(piece) + tail).encode()

    return render


def openai_usage_chunk(rid: str, model: str, prompt: int, completion: int) -> dict[str, Any]:
    """The final usage chunk (``stream_options.include_usage``): no choices."""
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def anthropic_stop_reason(finish: str) -> str:
    """``"length"`` -> ``"max_tokens"``, else ``"end_turn"``."""
    return "max_tokens" if finish == "length" else "end_turn"


def anthropic_message(
    rid: str, model: str, text: str, finish: str, prompt: int, completion: int
) -> dict[str, Any]:
    """A non-streaming Anthropic ``message``."""
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": anthropic_stop_reason(finish),
        "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": completion},
    }


def anthropic_start_events(rid: str, model: str, prompt: int) -> list[tuple[str, dict[str, Any]]]:
    """``message_start``, ``content_block_start`` and a ``ping``."""
    message: dict[str, Any] = {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 1},
    }
    return [
        ("message_start", {"type": "message_start", "message": message}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        ("ping", {"type": "ping"}),
    ]


def anthropic_delta_event(text: str) -> tuple[str, dict[str, Any]]:
    """A ``content_block_delta`` with a text delta."""
    return (
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
    )


def anthropic_end_events(
    finish: str, prompt: int, completion: int
) -> list[tuple[str, dict[str, Any]]]:
    """``content_block_stop``, ``message_delta`` (with usage) and ``message_stop``."""
    return [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": anthropic_stop_reason(finish), "stop_sequence": None},
                "usage": {"input_tokens": prompt, "output_tokens": completion},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def context_length_message(api: str, window: int, prompt_tokens: int) -> str:
    """The API's wording of a prompt over the context window."""
    if api in ("gemini", "bedrock"):
        from batchgen.simulator import native_errors as native

        return native.context_length_message(api, window, prompt_tokens)
    if api == "anthropic":
        return f"prompt is too long: {prompt_tokens} tokens > {window} maximum"
    return (
        f"This model's maximum context length is {window} tokens. "
        f"However, your messages resulted in {prompt_tokens} tokens."
    )


def rate_limit_message(
    model: str,
    what: str,
    limit: int | None,
    used: int | None,
    requested: int,
    retry_s: float | None,
) -> str:
    """OpenAI-style 429 text; ``retry_s=None`` means the request can never fit."""
    unit = "RPM" if what == "requests" else "TPM"
    head = f"on {what} per min ({unit}): Limit {limit}"
    if retry_s is None:
        return f"Request too large for {model} {head}, Requested {requested}."
    return (
        f"Rate limit reached for {model} {head}, Used {used}, Requested {requested}. "
        f"Please try again in {retry_s:.3f}s."
    )


def sse(api: str, event: str, data: dict[str, Any] | str) -> bytes:
    """One server-sent event (Anthropic names the event; OpenAI sends data only)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    prefix = f"event: {event}\n" if api == "anthropic" else ""
    return f"{prefix}data: {payload}\n\n".encode()
