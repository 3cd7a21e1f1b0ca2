"""An OpenAI chat body as an Anthropic Messages body, and a Messages answer as a
``chat.completion`` (pure): the record format of Bedrock batch inference for Claude
models (a ``modelInput`` is the model's InvokeModel body, with Bedrock's
``anthropic_version``; a ``modelOutput`` its ``Message``).

Parts: system text, text, images (base64 blocks), ``tool_use`` and ``tool_result``
blocks, tools (``input_schema``), ``tool_choice``, a JSON schema (``output_format``),
``max_tokens``, ``temperature``, ``top_p``, ``stop_sequences``.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from batchgen.domain.formats.chat import (
    BEDROCK,
    Chat,
    Image,
    Part,
    ToolCall,
    ToolResult,
    completion,
    message,
    parse_chat,
    tool_call,
    usage,
)

BEDROCK_VERSION = "bedrock-2023-05-31"
STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
    "pause_turn": "stop",
    "model_context_window_exceeded": "length",
}


def _block(part: Part) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if isinstance(part, Image):
        data = base64.b64encode(part.data or b"").decode()
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": part.mime, "data": data},
        }
    if isinstance(part, ToolCall):
        return {"type": "tool_use", "id": part.id, "name": part.name, "input": part.arguments}
    assert isinstance(part, ToolResult)
    return {"type": "tool_result", "tool_use_id": part.id, "content": part.text}


def request(body: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    """The InvokeModel body of a Claude model on Bedrock for ``body`` (raises
    :class:`~batchgen.domain.formats.chat.Untranslatable`)."""
    return from_chat(parse_chat(body, BEDROCK), max_tokens)


def from_chat(chat: Chat, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "anthropic_version": BEDROCK_VERSION,
        "max_tokens": chat.max_tokens or max_tokens,
        "messages": [{"role": t.role, "content": [_block(p) for p in t.parts]} for t in chat.turns],
    }
    if chat.system:
        out["system"] = "\n\n".join(chat.system)
    if chat.temperature is not None:
        out["temperature"] = chat.temperature
    if chat.top_p is not None:
        out["top_p"] = chat.top_p
    if chat.stop:
        out["stop_sequences"] = chat.stop
    if chat.tools:
        out["tools"] = [
            {
                "name": t.name,
                **({"description": t.description} if t.description else {}),
                "input_schema": t.parameters or {"type": "object", "properties": {}},
            }
            for t in chat.tools
        ]
        if chat.forced_tool:
            out["tool_choice"] = {"type": "tool", "name": chat.forced_tool}
        elif chat.tool_choice == "required":
            out["tool_choice"] = {"type": "any"}
        elif chat.tool_choice == "auto":
            out["tool_choice"] = {"type": "auto"}
    if chat.json_schema is not None:
        out["output_format"] = {"type": "json_schema", "schema": chat.json_schema}
    return out


def chat_completion(answer: Mapping[str, Any], model: str, created: int) -> dict[str, Any]:
    """A Messages ``Message`` as a ``chat.completion`` (thinking is not the answer's
    text); raises ``KeyError`` / ``TypeError`` without its content or usage."""
    texts, calls = [], []
    for block in answer["content"]:
        if block.get("type") == "text":
            texts.append(str(block.get("text") or ""))
        elif block.get("type") == "tool_use":
            calls.append(tool_call(str(block["id"]), str(block["name"]), block.get("input")))
    raw = answer["usage"]
    read = int(raw.get("cache_read_input_tokens") or 0)
    written = int(raw.get("cache_creation_input_tokens") or 0)
    prompt = int(raw["input_tokens"]) + read + written
    reason = answer.get("stop_reason")
    choice = {
        "index": 0,
        "message": message("".join(texts), calls),
        "finish_reason": STOP_REASONS.get(str(reason), "stop") if reason else None,
    }
    out_usage = usage(prompt, int(raw["output_tokens"]), cached=read, cache_write=written)
    return completion(str(answer.get("id") or ""), model, created, [choice], out_usage)
