"""Anthropic's Message Batches, in and out of the one item format (pure).

A Message Batch request (``{custom_id, params}``, ``params`` as the Messages API
takes them) becomes a line of the OpenAI Batch input format, so that it is
validated, stored, dispatched, budgeted and ledgered exactly as any other item;
the Anthropic adapter turns it back into a Messages request when it is called.
Its result (a chat completion, whatever the provider) comes back out as an
Anthropic ``Message`` inside a ``MessageBatchIndividualResponse``.

Only text is carried (a string or ``text`` blocks); any other block (images, tool
use) is refused at submission, naming the request and the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from batchgen.domain.admission import CHAT_COMPLETIONS
from batchgen.errors import ValidationFailed

MESSAGES = "/v1/messages"
# Messages parameters carried over as they are (both APIs read them the same).
SAME_PARAMS = ("model", "max_tokens", "temperature", "top_p", "metadata")
# Parameters of the Messages API the item format has no place for.
UNSUPPORTED_PARAMS = (
    "tools",
    "tool_choice",
    "thinking",
    "stream",
    "top_k",
    "container",
    "mcp_servers",
)
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}
# Our error codes as the error types of Anthropic's ErrorResponse.
ERROR_TYPES = {
    "rate_limited": "rate_limit_error",
    "too_large": "request_too_large",
    "context_length_exceeded": "invalid_request_error",
    "bad_request": "invalid_request_error",
}


OPENAI_FORMAT, ANTHROPIC_FORMAT = "openai", "anthropic"
_WHOLE_REQUESTS = re.compile(rb'\{\s*"requests"\s*:')


def sniff_format(head: bytes) -> str:
    """Which batch file this is, from its first bytes: Anthropic's (JSONL of
    ``{custom_id, params}``, or one JSON object ``{"requests": [...]}``) or OpenAI's
    (JSONL of ``{custom_id, method, url, body}``), the default."""
    text = head.lstrip()
    if _WHOLE_REQUESTS.match(text):
        return ANTHROPIC_FORMAT
    first = text.split(b"\n", 1)[0]
    try:
        line = json.loads(first)
    except ValueError:
        return ANTHROPIC_FORMAT if b'"requests"' in first[:200] else OPENAI_FORMAT
    if isinstance(line, dict) and "params" in line and "body" not in line:
        return ANTHROPIC_FORMAT
    if isinstance(line, dict) and isinstance(line.get("requests"), list):
        return ANTHROPIC_FORMAT
    return OPENAI_FORMAT


def parse_requests(content: bytes) -> list[Any]:
    """The requests of an Anthropic batch file: one JSON object with ``requests``, or
    JSONL with one request per line; raises :class:`ValidationFailed`."""
    try:
        whole = json.loads(content)
    except ValueError:
        whole = None
    if isinstance(whole, dict):
        if "requests" in whole:
            requests = whole["requests"]
            if not isinstance(requests, list):
                raise ValidationFailed("requests must be a list", field="requests")
            return requests
        return [whole]
    out: list[Any] = []
    for line_no, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            out.append(json.loads(raw))
        except ValueError as exc:
            raise ValidationFailed(f"malformed JSON: {exc}", line=line_no) from exc
    return out


def _fail(index: int, field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"requests[{index}].{field}: {message}", line=index + 1, field=field)


def _text(content: Any, index: int, field: str) -> str | list[dict[str, str]]:
    """A Messages content (a string or text blocks) as chat content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise _fail(index, field, "must be a string or a non-empty list of text blocks")
    parts: list[dict[str, str]] = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _fail(index, f"{field}[{i}]", "only text blocks are supported")
        if not isinstance(block.get("text"), str):
            raise _fail(index, f"{field}[{i}].text", "must be a string")
        parts.append({"type": "text", "text": block["text"]})
    return parts


def to_chat_line(index: int, request: Any) -> dict[str, Any]:
    """One Message Batch request as a line of the OpenAI Batch input format; raises
    :class:`ValidationFailed` naming ``requests[index]`` and the field."""
    if not isinstance(request, dict):
        raise ValidationFailed(f"requests[{index}] must be an object", line=index + 1)
    params = request.get("params")
    if not isinstance(params, dict):
        raise _fail(index, "params", "is required and must be an object")
    for name in UNSUPPORTED_PARAMS:
        if params.get(name):
            raise _fail(index, f"params.{name}", "is not supported in batches here")
    messages = params.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail(index, "params.messages", "is required and must be a non-empty list")
    chat: list[dict[str, Any]] = []
    system = params.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _text(system, index, "params.system")})
    for i, message in enumerate(messages):
        field = f"params.messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _fail(index, f"{field}.role", "must be 'user' or 'assistant'")
        chat.append(
            {
                "role": message["role"],
                "content": _text(message.get("content"), index, f"{field}.content"),
            }
        )
    body: dict[str, Any] = {k: params[k] for k in SAME_PARAMS if k in params}
    body["messages"] = chat
    stop = params.get("stop_sequences")
    if stop:
        body["stop"] = stop
    line: dict[str, Any] = {"method": "POST", "url": CHAT_COMPLETIONS, "body": body}
    if "custom_id" in request:
        line["custom_id"] = request["custom_id"]
    return line


def to_message(completion: dict[str, Any]) -> dict[str, Any]:
    """A chat completion (a result of record) as Anthropic's ``Message``."""
    choice = (completion.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    usage = completion.get("usage") or {}
    finish = choice.get("finish_reason")
    return {
        "id": completion.get("id") or "",
        "type": "message",
        "role": "assistant",
        "model": completion.get("model") or "",
        "content": [{"type": "text", "text": text}],
        "stop_reason": STOP_REASONS.get(finish or "", "end_turn") if finish else None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens") or 0),
            "output_tokens": int(usage.get("completion_tokens") or 0),
        },
    }


def to_individual_response(row: dict[str, Any]) -> dict[str, Any]:
    """A result row (the OpenAI Batch output format) as Anthropic's
    ``MessageBatchIndividualResponse``: succeeded, errored, canceled or expired."""
    custom_id = row["custom_id"]
    if row["response"] is not None:
        message = to_message(row["response"]["body"])
        return {"custom_id": custom_id, "result": {"type": "succeeded", "message": message}}
    code = row["error"]["code"]
    if code == "expired":
        return {"custom_id": custom_id, "result": {"type": "expired"}}
    if code == "cancelled":
        return {"custom_id": custom_id, "result": {"type": "canceled"}}
    error = {
        "type": ERROR_TYPES.get(code, "api_error"),
        "message": row["error"]["message"] or code,
    }
    return {
        "custom_id": custom_id,
        "result": {"type": "errored", "error": {"type": "error", "error": error}},
    }
