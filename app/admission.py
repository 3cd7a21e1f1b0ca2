"""Validation of an OpenAI Batch API input file, one line at a time.

Pure: no database, no network. :func:`parse_lines` streams a binary JSONL
body and yields one :class:`ItemDraft` per line, raising a
:class:`ValidationFailed` that names the line and the field at the first bad
line. Token estimates are computed here, once, and stored on the item.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from app import tokens
from app.deadlines import parse_duration_s
from app.errors import PayloadTooLarge, ValidationFailed
from app.registry import Registry

CHAT_COMPLETIONS = "/v1/chat/completions"
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True, slots=True)
class ItemDraft:
    """One validated request line, ready to store."""

    line_no: int
    custom_id: str
    model: str
    body: dict[str, Any]
    prompt_tokens_est: int
    max_tokens: int
    timeout_s: float | None = None  # optional per-item deadline, from admission


@dataclass(frozen=True, slots=True)
class Limits:
    max_lines: int
    max_bytes: int


def _fail(line_no: int, field: str | None, message: str) -> ValidationFailed:
    where = f"line {line_no}" + (f", field {field!r}" if field else "")
    return ValidationFailed(f"{where}: {message}", line=line_no, field=field)


def _max_tokens(body: dict[str, Any], line_no: int, limit: int, model: str) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        if key in body:
            value = body[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise _fail(line_no, f"body.{key}", "must be an integer")
            if value <= 0:
                raise _fail(line_no, f"body.{key}", "must be greater than 0")
            if value > limit:
                raise _fail(
                    line_no, f"body.{key}", f"{value} exceeds the limit of {limit} for {model}"
                )
            return value
    # No limit given: reserve the model's maximum, as the provider would allow.
    return limit


def _messages(body: dict[str, Any], line_no: int) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise _fail(line_no, "body.messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise _fail(line_no, "body.messages", "must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _fail(line_no, f"body.messages[{i}]", "must be an object")
        if not isinstance(message.get("role"), str):
            raise _fail(line_no, f"body.messages[{i}].role", "is required")
        if "content" not in message:
            raise _fail(line_no, f"body.messages[{i}].content", "is required")
    return messages


def validate_line(raw: bytes, line_no: int, registry: Registry) -> ItemDraft:
    """Validate one JSONL line; raises :class:`ValidationFailed`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(line_no, None, f"not valid UTF-8 (byte {exc.start})") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(line_no, None, f"malformed JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(obj, dict):
        raise _fail(line_no, None, "must be a JSON object")

    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _fail(line_no, "custom_id", "is required and must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise _fail(line_no, "custom_id", f"longer than {MAX_CUSTOM_ID_CHARS} characters")
    method = obj.get("method", "POST")
    if method != "POST":
        raise _fail(line_no, "method", "must be POST")
    url = obj.get("url")
    if url != CHAT_COMPLETIONS:
        raise _fail(line_no, "url", f"must be {CHAT_COMPLETIONS!r}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _fail(line_no, "body", "is required and must be an object")
    model_name = body.get("model")
    if not isinstance(model_name, str):
        raise _fail(line_no, "body.model", "is required")
    spec = registry.get(model_name)
    if spec is None:
        raise _fail(line_no, "body.model", f"unknown model {model_name!r}")
    if body.get("stream"):
        raise _fail(line_no, "body.stream", "streaming is not available in batches")
    messages = _messages(body, line_no)
    max_tokens = _max_tokens(body, line_no, spec.max_output_tokens, model_name)
    prompt_tokens = tokens.count_messages(messages, spec.encoding)
    if prompt_tokens + max_tokens > spec.context_window:
        raise _fail(
            line_no,
            "body.messages",
            f"prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} exceeds "
            f"the context window of {spec.context_window} for {model_name}",
        )
    timeout_s = None
    if "timeout" in obj:  # our extension of the Batch format: a per-item deadline
        try:
            timeout_s = parse_duration_s(obj["timeout"], "timeout")
        except ValidationFailed as exc:
            raise _fail(line_no, "timeout", exc.message) from exc
    return ItemDraft(line_no, custom_id, model_name, body, prompt_tokens, max_tokens, timeout_s)


def iter_lines(stream: Iterable[bytes], limits: Limits) -> Iterator[tuple[int, bytes]]:
    """Numbered non-blank lines of a byte stream, enforcing line and byte limits."""
    total_bytes = 0
    line_no = 0
    count = 0
    for raw in stream:
        total_bytes += len(raw)
        if total_bytes > limits.max_bytes:
            raise PayloadTooLarge(f"body larger than {limits.max_bytes} bytes")
        line_no += 1
        if not raw.strip():
            continue
        count += 1
        if count > limits.max_lines:
            raise PayloadTooLarge(f"more than {limits.max_lines} lines", line=line_no)
        yield line_no, raw.rstrip(b"\r\n")


def parse_lines(stream: Iterable[bytes], registry: Registry, limits: Limits) -> Iterator[ItemDraft]:
    """Validate a JSONL body line by line; duplicates of custom_id are rejected."""
    seen: set[str] = set()
    any_line = False
    for line_no, raw in iter_lines(stream, limits):
        any_line = True
        draft = validate_line(raw, line_no, registry)
        if draft.custom_id in seen:
            raise _fail(line_no, "custom_id", f"duplicate custom_id {draft.custom_id!r}")
        seen.add(draft.custom_id)
        yield draft
    if not any_line:
        raise ValidationFailed("the batch is empty: no request lines")
