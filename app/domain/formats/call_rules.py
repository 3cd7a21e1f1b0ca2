"""Synchronous calls (``POST /v1/chat/completions``, ``/v1/responses``, ``/v1/embeddings``,
``/v1/messages``): their
deadline, the fail-fast rule, and their answer as either SDK reads it (pure).

A call is a one-item batch of priority ``call``: it is validated, budgeted, run and
ledgered as any item. What is particular to it is decided here: how long its
caller waits (the deadline covers queueing), whether the model's backlog can meet
that at all (if not, 503 at once, with the wait as ``Retry-After``), and how the
result of record is written back, whole or as a stream of server-sent events.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

from batchgen.domain.formats import answers, response_stream
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS, EMBEDDINGS
from batchgen.domain.lifecycle.deadlines import parse_duration_s
from batchgen.domain.lifecycle.status import TERMINAL, ItemStatus
from batchgen.errors import CallFailed, ValidationFailed

CALL_CUSTOM_ID = "call"
# Where a caller's deadline is read, first found wins: ours, then the SDKs' own read
# timeout (both official SDKs send it on every request).
TIMEOUT_HEADERS = ("x-request-timeout", "x-stainless-read-timeout")
# Body fields of a streamed call that the item format does not keep (the worker
# streams on its own); the answer is streamed back to the caller from the result.
STREAM_FIELDS = ("stream", "stream_options")


def call_deadline_s(
    body_timeout: Any, headers: Mapping[str, str], default_s: float, max_s: float
) -> float:
    """The seconds a caller waits, queueing included: its ``timeout`` (the body's, or
    a header's), else ``default_s``; never more than ``max_s``."""
    for name in TIMEOUT_HEADERS:
        if headers.get(name):
            return min(max_s, _seconds(headers[name], name))
    if body_timeout is not None:
        return min(max_s, _seconds(body_timeout, "timeout"))
    return min(max_s, default_s)


def _seconds(value: Any, field: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return parse_duration_s(value, field)
    return parse_duration_s(value, field)


def expected_wait_s(ahead_tokens: int, tokens_per_min: int, cooldown_s: float) -> float:
    """How long before a new call could start: the calls ahead of it on the model
    (their tokens at the model's rate), after any cooldown the provider imposed."""
    rate_per_s = max(1.0, tokens_per_min / 60.0)
    return max(0.0, cooldown_s) + ahead_tokens / rate_per_s


def refuse_after_s(wait_s: float, deadline_s: float) -> int | None:
    """The fail-fast rule: ``Retry-After`` seconds when the wait alone uses up the
    caller's deadline, else None (the call is taken)."""
    if wait_s < deadline_s:
        return None
    return max(1, math.ceil(wait_s))


def as_line(body: Any, endpoint: str = CHAT_COMPLETIONS) -> tuple[dict[str, Any], bool, bool]:
    """A request body of ``endpoint`` (chat, by default) as the one line of a call's
    batch, and whether the caller asked for a stream (and, of a chat, for the usage
    chunk at its end). Embeddings have no stream."""
    if not isinstance(body, dict):
        raise ValidationFailed("the body must be a JSON object", field="body")
    stream = bool(body.get("stream"))
    if stream and endpoint == EMBEDDINGS:
        raise ValidationFailed(f"{EMBEDDINGS} does not stream", field="stream")
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    kept = {k: v for k, v in body.items() if k not in STREAM_FIELDS and k != "timeout"}
    line = {"custom_id": CALL_CUSTOM_ID, "method": "POST", "url": endpoint, "body": kept}
    return line, stream, include_usage


# Item error codes as the HTTP status of a call that ended without an answer.
_CALL_STATUS = {
    "context_length_exceeded": (400, "context_length_exceeded"),
    "too_large": (400, "too_large"),
    "rate_limited": (429, "rate_limited"),
    "expired": (504, "deadline_exceeded"),
    "cancelled": (409, "cancelled"),
}


def call_error(error_code: str | None, message: str | None) -> CallFailed:
    """The error a call that ended without an answer is answered with: the provider
    refusing the request's size is a 400, its limits a 429, the deadline a 504, a
    cancel a 409, and anything else the provider did (after the retries) a 502."""
    status, code = _CALL_STATUS.get(error_code or "", (502, "upstream_error"))
    return CallFailed(status, code, message or code)


def key_replays(status: ItemStatus, error_code: str | None) -> bool:
    """Whether the call that holds an ``Idempotency-Key`` answers a request under it
    again: while it is open, once it succeeded, or when it failed for the request's own
    fault (a 4xx other than a cancel or the provider's limits). A call cancelled (its
    caller hung up), expired, rate-limited or failed at the provider leaves the key to
    a new call: a client retrying with its key gets an answer, not that end again."""
    if status is ItemStatus.SUCCEEDED or status not in TERMINAL:
        return True
    if status is not ItemStatus.FAILED:
        return False
    code = call_error(error_code, None).status_code
    return 400 <= code < 500 and code not in (409, 429)


# --- the answer, streamed --------------------------------------------------------


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def openai_stream(completion: dict[str, Any], include_usage: bool) -> Iterator[bytes]:
    """A chat completion as the ``chat.completion.chunk`` events of a stream (every
    choice, its content, logprobs, refusal and tool calls, then its finish reason), the
    usage when asked for, and ``[DONE]``: :func:`batchgen.domain.formats.answers.openai_chunks`."""
    for chunk in answers.openai_chunks(completion, include_usage):
        yield sse(chunk)
    yield b"data: [DONE]\n\n"


def anthropic_stream(message: dict[str, Any]) -> Iterator[bytes]:
    """An Anthropic ``Message`` as the events of a Messages stream (every content
    block: :func:`batchgen.domain.formats.answers.anthropic_events`)."""
    for event, data in answers.anthropic_events(message):
        yield sse(data, event)


def responses_stream(response: dict[str, Any]) -> Iterator[bytes]:
    """A Responses API ``Response`` as the events of its stream
    (:func:`batchgen.domain.formats.response_stream.response_events`)."""
    for kind, data in response_stream.response_events(response):
        yield response_stream.sse(kind, data)


# While a streamed call waits, a comment line keeps the connection alive (and finds out
# whether the caller is still there: a write to a closed socket fails).
KEEPALIVE = b": waiting\n\n"
