"""A Responses API request (``POST /v1/responses``): its validation, and its prompt as
the token counter reads it (pure).

What the API requires is checked, each fault named by its path (``body.input[2].
content[0].text``): ``input`` (a string, or a list of input items: messages with a
``role`` and a ``content``, or typed items such as ``function_call`` and
``function_call_output``), ``instructions``, ``max_output_tokens`` and ``tools``. The
body itself travels to the provider as it came.

The prompt is counted the way a chat request's is (:mod:`batchgen.domain.formats.tokens`): the
``instructions`` as a leading developer message, every input item as a message (its
text parts, its images by the provider's formula, a function call's name and
arguments, a function output), the function tools and a ``json_schema`` text format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchgen.errors import ValidationFailed

ROLES = ("user", "assistant", "system", "developer")
# Content parts an input message may hold, and the field each must carry.
PART_TEXT = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
PART_TYPES = (*PART_TEXT, "input_image", "input_file", "input_audio")
IMAGE_DETAILS = ("low", "high", "auto")
# Fields of a typed input item that must be strings.
ITEM_STRINGS = {
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id",),
}
TEXT_FORMATS = ("text", "json_object", "json_schema")
# batchgen calls the provider with keys every tenant shares: an object the provider
# stored under them (a response, a conversation, an uploaded file) is not one tenant's,
# so a request may not name one. Its text goes in the request itself.
SHARED_KEY = "names an object stored at the provider under keys all tenants share"
PROVIDER_REFERENCES = ("previous_response_id", "conversation", "prompt")


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(message, field=field)


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _fail(field, "must be a string")
    return value


def _part(part: Any, field: str) -> None:
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        raise _fail(field, "must be a content part with a 'type'")
    kind = part["type"]
    if kind not in PART_TYPES:
        raise _fail(f"{field}.type", f"must be one of {', '.join(PART_TYPES)}, got {kind!r}")
    if kind in PART_TEXT:
        _string(part.get(PART_TEXT[kind]), f"{field}.{PART_TEXT[kind]}")
    if part.get("file_id") is not None:
        raise _fail(f"{field}.file_id", f"{SHARED_KEY}: send the file's data inline")
    if kind == "input_image":
        if not isinstance(part.get("image_url"), str):
            raise _fail(field, "an input_image needs an 'image_url' (a URL or a data URL)")
        detail = part.get("detail", "auto")
        if detail is not None and detail not in IMAGE_DETAILS:
            raise _fail(f"{field}.detail", f"must be one of {', '.join(IMAGE_DETAILS)}")


def _message(item: Mapping[str, Any], field: str) -> None:
    if item.get("role") not in ROLES:
        raise _fail(f"{field}.role", f"must be one of {', '.join(ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise _fail(f"{field}.content", "must be a string or a non-empty list of content parts")
    for i, part in enumerate(content):
        _part(part, f"{field}.content[{i}]")


def _item(item: Any, field: str) -> None:
    if not isinstance(item, Mapping):
        raise _fail(field, "must be an input item (an object)")
    kind = item.get("type")
    if "role" in item or kind == "message":
        if kind not in (None, "message"):
            raise _fail(f"{field}.type", "an item with a 'role' is a 'message'")
        _message(item, field)
        return
    if not isinstance(kind, str):
        raise _fail(field, "must be a message (with 'role' and 'content') or an item with a 'type'")
    if kind == "item_reference":
        raise _fail(f"{field}.type", f"an item_reference {SHARED_KEY}: send the item itself")
    for name in ITEM_STRINGS.get(kind, ()):
        _string(item.get(name), f"{field}.{name}")
    if kind == "function_call_output" and not isinstance(item.get("output"), str | list):
        raise _fail(f"{field}.output", "must be a string or a list of content parts")


def _tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise _fail("body.tools", "must be a list of tools")
    for i, tool in enumerate(tools):
        field = f"body.tools[{i}]"
        if not isinstance(tool, Mapping) or not isinstance(tool.get("type"), str):
            raise _fail(field, "must be a tool with a 'type'")
        if tool["type"] == "function":
            _string(tool.get("name"), f"{field}.name")
            if tool.get("parameters") is not None and not isinstance(tool["parameters"], Mapping):
                raise _fail(f"{field}.parameters", "must be a JSON schema object")


def _text_format(text: Any) -> None:
    if not isinstance(text, Mapping):
        raise _fail("body.text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, Mapping) or fmt.get("type") not in TEXT_FORMATS:
        raise _fail("body.text.format.type", f"must be one of {', '.join(TEXT_FORMATS)}")
    if fmt["type"] == "json_schema":
        _string(fmt.get("name"), "body.text.format.name")
        if not isinstance(fmt.get("schema"), Mapping):
            raise _fail("body.text.format.schema", "must be a JSON schema object")


def check_body(body: Mapping[str, Any]) -> None:
    """Raise :class:`ValidationFailed` (its ``field`` the path) unless ``body`` is a
    Responses request the API takes. The model, ``stream`` and the output bound are the
    caller's to check."""
    for name in PROVIDER_REFERENCES:
        if body.get(name) is not None:
            raise _fail(f"body.{name}", f"{SHARED_KEY}; send the whole input instead")
    if "input" not in body or body["input"] is None:
        raise _fail("body.input", "is required")
    value = body["input"]
    if isinstance(value, str):
        if not value:
            raise _fail("body.input", "must not be empty")
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            _item(item, f"body.input[{i}]")
    else:
        raise _fail("body.input", "must be a string or a non-empty list of input items")
    if body.get("instructions") is not None:
        _string(body["instructions"], "body.instructions")
    if body.get("tools") is not None:
        _tools(body["tools"])
    if body.get("text") is not None:
        _text_format(body["text"])
    if body.get("background"):
        raise _fail(
            "body.background",
            "background responses are not run here: a call is answered when it ends",
        )


# --- the prompt, as the token counter reads it --------------------------------------


@dataclass(frozen=True)
class Prompt:
    """A Responses request as a chat request's parts: its messages (text and images),
    and what the counter adds beside them (function tools, a json_schema format)."""

    messages: list[dict[str, Any]]
    extras: dict[str, Any]


def _chat_part(part: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = part.get("type")
    if kind in PART_TEXT:
        return {"type": "text", "text": part.get(PART_TEXT[str(kind)]) or ""}
    if kind == "input_image":
        url = part.get("image_url") if isinstance(part.get("image_url"), str) else ""
        return {"type": "image_url", "image_url": {"url": url, "detail": part.get("detail")}}
    return None  # files and audio: not counted (the provider's own formulas are unknown)


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _as_message(item: Mapping[str, Any]) -> dict[str, Any]:
    if "role" in item:
        content = item.get("content")
        if isinstance(content, list):
            parts = [p for p in (_chat_part(x) for x in content if isinstance(x, Mapping)) if p]
            return {"role": item["role"], "content": parts}
        return {"role": item["role"], "content": content}
    kind = item.get("type")
    if kind == "function_call":
        return {"role": "assistant", "name": item.get("name"), "content": item.get("arguments")}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output if isinstance(output, str) else _compact(output)}
    # Any other item (reasoning, a tool call of a built-in tool...): its fields as JSON.
    rest = {k: v for k, v in item.items() if k not in ("type", "id", "status")}
    return {"role": str(kind), "content": _compact(rest)}


def prompt(body: Mapping[str, Any]) -> Prompt:
    """The prompt of a validated Responses request (:func:`check_body`) to count."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "developer", "content": body["instructions"]})
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    else:
        messages.extend(_as_message(item) for item in value)
    extras: dict[str, Any] = {}
    tools = [t for t in body.get("tools") or () if t.get("type") == "function"]
    if tools:
        extras["tools"] = tools
    fmt = (body.get("text") or {}).get("format")
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        extras["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")},
        }
    return Prompt(messages, extras)
