"""The simulator's count of a request's prompt tokens, the providers' way.

Independent of batchgen's estimate (:mod:`batchgen.domain.formats.tokens` is used only for
tiktoken itself: its message count and text count): tool definitions are rendered
into the prompt as OpenAI renders them (a TypeScript-like ``namespace functions``
in the system message), a json_schema response format likewise, and images cost
what the providers document for their pixel size, read from the image's own header.
So a test comparing batchgen's estimate with what the simulator reports compares two
ways of counting, not one function with itself.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from batchgen.domain.formats.tokens import count_messages, count_text

# OpenAI, "Images and vision": low detail 85; high: fit 2048 x 2048, shortest side to
# 768, then 85 + 170 per 512 px tile. Anthropic, "Vision": (w x h) / 750 after scaling
# to a long edge of at most 1568 px and about 1.15 megapixels.
LOW_DETAIL = 85
TILE = 170
ANTHROPIC_MAX_LONG_EDGE = 1568
ANTHROPIC_MAX_PIXELS = 1_200_000
ANTHROPIC_TOOL_SYSTEM_PROMPT = 346  # tool_choice auto/none; 313 for any/tool
ANTHROPIC_TOOL_SYSTEM_PROMPT_FORCED = 313
UNKNOWN_SIZE = (768, 2048)


def _ts_type(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return "any"
    if isinstance(schema.get("enum"), list):
        return " | ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return f"{_ts_type(schema.get('items'))}[]"
    if kind == "object" and isinstance(schema.get("properties"), Mapping):
        return "{\n" + _ts_fields(schema) + "}"
    if kind == "integer":
        return "number"
    return kind if isinstance(kind, str) else "any"


def _ts_fields(schema: Mapping[str, Any]) -> str:
    required = set(schema.get("required") or [])
    lines = []
    for name, prop in schema.get("properties", {}).items():
        desc = prop.get("description") if isinstance(prop, Mapping) else None
        if desc:
            lines.append(f"// {desc}\n")
        optional = "" if name in required else "?"
        lines.append(f"{name}{optional}: {_ts_type(prop)},\n")
    return "".join(lines)


def render_openai_tools(tools: Sequence[Any]) -> str:
    """The tool definitions as OpenAI puts them in the prompt."""
    out = ["# Tools\n\n## functions\n\nnamespace functions {\n\n"]
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
        if fn.get("description"):
            out.append(f"// {fn['description']}\n")
        params = fn.get("parameters")
        if isinstance(params, Mapping) and params.get("properties"):
            out.append(f"type {fn.get('name')} = (_: {{\n{_ts_fields(params)}}}) => any;\n\n")
        else:
            out.append(f"type {fn.get('name')} = () => any;\n\n")
    out.append("} // namespace functions")
    return "".join(out)


def _png_or_jpeg_size(data: bytes) -> tuple[int, int] | None:
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return struct.unpack("<HH", data[6:10])
    if data[:2] == b"\xff\xd8":
        i = 2
        while i + 9 < len(data) and data[i] == 0xFF:
            marker, length = data[i + 1], int.from_bytes(data[i + 2 : i + 4], "big")
            if marker in (0xC0, 0xC1, 0xC2):
                h, w = struct.unpack(">HH", data[i + 5 : i + 9])
                return w, h
            i += 2 + length
    return None


def _decoded_size(b64: str) -> tuple[int, int] | None:
    try:
        return _png_or_jpeg_size(base64.b64decode(b64))
    except (ValueError, IndexError, struct.error):  # not base64, or a cut-off header
        return None


def openai_image(size: tuple[int, int] | None, detail: str) -> int:
    if detail == "low":
        return LOW_DETAIL
    w, h = size or UNKNOWN_SIZE
    if w > 2048 or h > 2048:
        f = 2048 / max(w, h)
        w, h = int(w * f), int(h * f)
    if min(w, h) > 768:
        f = 768 / min(w, h)
        w, h = int(w * f), int(h * f)
    return LOW_DETAIL + TILE * math.ceil(w / 512) * math.ceil(h / 512)


def anthropic_image(size: tuple[int, int] | None) -> int:
    if size is None:
        return 1600
    w, h = size
    f = min(1.0, ANTHROPIC_MAX_LONG_EDGE / max(w, h), math.sqrt(ANTHROPIC_MAX_PIXELS / (w * h)))
    return math.ceil(int(w * f) * int(h * f) / 750)


def _images(messages: Sequence[Mapping[str, Any]], anthropic: bool) -> int:
    total = 0
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if not isinstance(part, Mapping):
                continue
            if part.get("type") == "image_url":
                image = part.get("image_url") or {}
                url = image.get("url", "") if isinstance(image, Mapping) else str(image)
                detail = image.get("detail", "auto") if isinstance(image, Mapping) else "auto"
                size = _decoded_size(url.partition(",")[2]) if url.startswith("data:") else None
            elif part.get("type") == "image":
                source = part.get("source") or {}
                size, detail = _decoded_size(source.get("data") or ""), "auto"
            else:
                continue
            total += anthropic_image(size) if anthropic else openai_image(size, detail)
    return total


def _anthropic_tools(tools: Sequence[Any], tool_choice: Any, encoding: str) -> int:
    choice = tool_choice.get("type") if isinstance(tool_choice, Mapping) else tool_choice
    forced = choice in ("any", "tool", "required", "function")
    total = ANTHROPIC_TOOL_SYSTEM_PROMPT_FORCED if forced else ANTHROPIC_TOOL_SYSTEM_PROMPT
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
        schema = fn.get("input_schema", fn.get("parameters"))
        definition = {"name": fn.get("name"), "description": fn.get("description")}
        total += count_text(json.dumps({**definition, "input_schema": schema}), encoding)
    return total


def prompt_tokens(
    api: str, body: Mapping[str, Any], messages: list[Mapping[str, Any]], encoding: str
) -> int:
    """What the provider of ``api`` counts as the prompt: "openai" (and Gemini's, here),
    "anthropic" (and Bedrock's: its models are mostly Claude)."""
    anthropic = api in ("anthropic", "bedrock")
    total = count_messages(messages, encoding) + _images(messages, anthropic)
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        if anthropic:
            total += _anthropic_tools(tools, body.get("tool_choice"), encoding)
        else:
            total += count_text(render_openai_tools(tools), encoding)
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") == "json_schema":
        schema = response_format.get("json_schema") or {}
        rendered = f"# Response Formats\n\n## {schema.get('name', 'response')}\n\n" + json.dumps(
            schema.get("schema", schema)
        )
        total += count_text(rendered, encoding)
    return total
