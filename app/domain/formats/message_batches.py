"""Anthropic's Message Batches, in and out of the one item format (pure).

A Message Batch request (``{custom_id, params}``, ``params`` as the Messages API
takes them) becomes a line of the OpenAI Batch input format, so that it is
validated, stored, dispatched, budgeted and ledgered exactly as any other item;
the Anthropic adapter turns it back into a Messages request when it is called.
Its result (a chat completion, whatever the provider) comes back out as an
Anthropic ``Message`` inside a ``MessageBatchIndividualResponse``.

The request's own parameters travel with the line whole (``body.anthropic_params``,
:data:`NATIVE_PARAMS`): tools, tool_choice, thinking, ``cache_control`` blocks, a
system prompt given as a list, image and document blocks reach an Anthropic provider
as the caller wrote them, and its ``Message`` is the result of record, returned as it
came. The line's chat ``messages`` (the text of the text blocks) are what admission
counts, and what a non-Anthropic provider is sent: a request for a model of another
kind is refused, by name, when it carries what that translation would drop (images
and other non-text blocks, ``thinking``, server tools), not sent without it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from batchgen.domain.formats import endpoints
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS
from batchgen.errors import ValidationFailed

MESSAGES = endpoints.MESSAGES

# Messages parameters carried over as they are (both APIs read them the same).
SAME_PARAMS = ("model", "max_tokens", "temperature", "top_p", "metadata")
# The line body field that carries the Messages request's parameters as they were sent.
NATIVE_PARAMS = "anthropic_params"
# Parameters batchgen owns: a batch request is never streamed (a call's ``stream`` is
# taken off before it gets here).
UNSUPPORTED_PARAMS = ("stream",)
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


def _blocks_text(content: Any, index: int, field: str) -> str | list[dict[str, str]]:
    """The text of a Messages content as chat content (a string, or its text blocks
    as text parts); any block type is accepted, each an object with a ``type``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise _fail(index, field, "must be a string or a non-empty list of content blocks")
    parts: list[dict[str, str]] = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _fail(index, f"{field}[{i}]", "must be a content block with a 'type'")
        if block["type"] == "text":
            if not isinstance(block.get("text"), str):
                raise _fail(index, f"{field}[{i}].text", "must be a string")
            parts.append({"type": "text", "text": block["text"]})
    return parts or ""


def _chat_tools(tools: Any, index: int) -> list[dict[str, Any]]:
    """Messages ``tools`` as chat ``tools`` (what admission counts, and what a
    non-Anthropic provider is sent); a server tool (one with a ``type`` and no
    ``input_schema``, e.g. web search) has no chat form and is left out."""
    if not isinstance(tools, list):
        raise _fail(index, "params.tools", "must be a list of tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _fail(index, f"params.tools[{i}]", "must be a tool with a 'name'")
        if "input_schema" not in tool:
            continue
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _text_only(index: int, content: Any, field: str) -> None:
    """Refuse a content block other than text, naming it (a chat line keeps text only)."""
    for i, block in enumerate(content if isinstance(content, list) else ()):
        if block["type"] != "text":
            raise _fail(
                index,
                f"{field}[{i}]",
                f"a {block['type']!r} block needs a model served by an Anthropic provider",
            )


def check_chat_only(index: int, params: dict[str, Any]) -> None:
    """Refuse, by name, what a model of another provider kind would not be sent (it
    gets the chat translation: text and function tools): non-text blocks (images,
    documents, tool use and results), ``thinking``, server tools."""
    _text_only(index, params.get("system"), "params.system")
    for m, message in enumerate(params["messages"]):
        _text_only(index, message["content"], f"params.messages[{m}].content")
    if params.get("thinking") not in (None, {"type": "disabled"}):
        raise _fail(index, "params.thinking", "needs a model served by an Anthropic provider")
    for i, tool in enumerate(params.get("tools") or ()):
        if "input_schema" not in tool:
            raise _fail(
                index,
                f"params.tools[{i}]",
                "a server tool needs a model served by an Anthropic provider",
            )


def to_chat_line(index: int, request: Any, *, anthropic: bool = True) -> dict[str, Any]:
    """One Message Batch request as a line of the OpenAI Batch input format; raises
    :class:`ValidationFailed` naming ``requests[index]`` and the field.

    The line's ``body`` has the request's text as chat ``messages`` and its tools as
    chat ``tools`` (what admission counts), and the request's parameters whole under
    :data:`NATIVE_PARAMS`. For a model not served by an Anthropic provider
    (``anthropic=False``), what the chat translation drops is refused
    (:func:`check_chat_only`)."""
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
        chat.append({"role": "system", "content": _blocks_text(system, index, "params.system")})
    for i, message in enumerate(messages):
        field = f"params.messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _fail(index, f"{field}.role", "must be 'user' or 'assistant'")
        content = _blocks_text(message.get("content"), index, f"{field}.content")
        chat.append({"role": message["role"], "content": content})
    body: dict[str, Any] = {k: params[k] for k in SAME_PARAMS if k in params}
    body["messages"] = chat
    stop = params.get("stop_sequences")
    if stop:
        body["stop"] = stop
    tools = params.get("tools")
    if tools is not None:
        body["tools"] = _chat_tools(tools, index)
    body[NATIVE_PARAMS] = {k: v for k, v in params.items() if k != "model"}
    if not anthropic:
        check_chat_only(index, params)
    line: dict[str, Any] = {"method": "POST", "url": CHAT_COMPLETIONS, "body": body}
    if "custom_id" in request:
        line["custom_id"] = request["custom_id"]
    return line


def to_message(completion: dict[str, Any]) -> dict[str, Any]:
    """A result of record as Anthropic's ``Message``: an Anthropic provider's
    ``Message`` as it came; a chat completion's first choice translated (its text
    and tool calls)."""
    if completion.get("type") == "message":
        return completion
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    text = message.get("content") or ""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = {"arguments": function.get("arguments")}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": arguments,
            }
        )
    usage = completion.get("usage") or {}
    finish = choice.get("finish_reason")
    return {
        "id": completion.get("id") or "",
        "type": "message",
        "role": "assistant",
        "model": completion.get("model") or "",
        "content": content or [{"type": "text", "text": ""}],
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
