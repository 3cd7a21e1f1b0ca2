"""An OpenAI chat body as a Bedrock ``Converse`` request, and its answer (plain or a
``ConverseStream``) as a ``chat.completion`` (pure).

The request is ``boto3``'s keyword arguments of ``converse`` (``modelId`` aside);
the answer is ``converse``'s result, the stream ``converse_stream``'s events as
``boto3`` yields them. Usage: ``prompt_tokens`` is ``inputTokens`` plus the cache's
reads and writes (Bedrock counts them apart, as Anthropic does), ``cached_tokens``
its ``cacheReadInputTokens``, ``cache_creation_input_tokens`` its
``cacheWriteInputTokens``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from batchgen.domain.formats.chat import (
    BEDROCK,
    IMAGE_FORMATS,
    Chat,
    ChunkWriter,
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

STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "guardrail_intervened": "content_filter",
    "content_filtered": "content_filter",
    "malformed_model_output": "stop",
    "malformed_tool_use": "stop",
}


def _block(part: Part) -> dict[str, Any]:
    if isinstance(part, str):
        return {"text": part}
    if isinstance(part, Image):
        return {"image": {"format": IMAGE_FORMATS[part.mime], "source": {"bytes": part.data}}}
    if isinstance(part, ToolCall):
        return {"toolUse": {"toolUseId": part.id, "name": part.name, "input": part.arguments}}
    assert isinstance(part, ToolResult)
    return {"toolResult": {"toolUseId": part.id, "content": [{"text": part.text}]}}


def request(body: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    """``converse``'s arguments (but ``modelId``) of ``body`` (raises
    :class:`~batchgen.domain.formats.chat.Untranslatable`)."""
    return from_chat(parse_chat(body, BEDROCK), max_tokens)


def from_chat(chat: Chat, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": t.role, "content": [_block(p) for p in t.parts]} for t in chat.turns]
    inference: dict[str, Any] = {"maxTokens": chat.max_tokens or max_tokens}
    if chat.temperature is not None:
        inference["temperature"] = chat.temperature
    if chat.top_p is not None:
        inference["topP"] = chat.top_p
    if chat.stop:
        inference["stopSequences"] = chat.stop
    params: dict[str, Any] = {"messages": messages, "inferenceConfig": inference}
    if chat.system:
        params["system"] = [{"text": s} for s in chat.system]
    if chat.tools:
        tools = []
        for tool in chat.tools:
            spec: dict[str, Any] = {
                "name": tool.name,
                "inputSchema": {"json": tool.parameters or {"type": "object", "properties": {}}},
            }
            if tool.description:
                spec["description"] = tool.description
            tools.append({"toolSpec": spec})
        config: dict[str, Any] = {"tools": tools}
        if chat.forced_tool:
            config["toolChoice"] = {"tool": {"name": chat.forced_tool}}
        elif chat.tool_choice == "required":
            config["toolChoice"] = {"any": {}}
        elif chat.tool_choice == "auto":
            config["toolChoice"] = {"auto": {}}
        params["toolConfig"] = config
    if chat.json_schema is not None:
        schema: dict[str, Any] = {"schema": json.dumps(chat.json_schema)}
        if chat.schema_name:
            schema["name"] = chat.schema_name
        params["outputConfig"] = {
            "textFormat": {"type": "json_schema", "structure": {"jsonSchema": schema}}
        }
    return params


def stop_reason(reason: Any) -> str | None:
    return None if reason is None else STOP_REASONS.get(str(reason), "stop")


def answer_usage(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """Converse's ``usage`` as an OpenAI ``usage``; raises ``KeyError`` without one."""
    if not isinstance(raw, Mapping):
        raise KeyError("usage")
    read = int(raw.get("cacheReadInputTokens") or 0)
    written = int(raw.get("cacheWriteInputTokens") or 0)
    prompt = int(raw["inputTokens"]) + read + written
    return usage(prompt, int(raw["outputTokens"]), cached=read, cache_write=written)


def chat_completion(
    answer: Mapping[str, Any], rid: str, model: str, created: int
) -> dict[str, Any]:
    """A ``converse`` result as a ``chat.completion`` (reasoning blocks are not the
    answer's text); raises ``KeyError`` / ``TypeError`` for one without its message or
    usage."""
    blocks = answer["output"]["message"]["content"]
    texts, calls = [], []
    for block in blocks:
        if isinstance(block.get("text"), str):
            texts.append(block["text"])
        use = block.get("toolUse")
        if isinstance(use, Mapping):
            calls.append(tool_call(str(use["toolUseId"]), str(use["name"]), use.get("input")))
    choice = {
        "index": 0,
        "message": message("".join(texts), calls),
        "finish_reason": stop_reason(answer.get("stopReason")),
    }
    return completion(rid, model, created, [choice], answer_usage(answer.get("usage")))


class StreamMerge:
    """``converse_stream`` events: each as the ``chat.completion.chunk`` objects it makes
    (:meth:`add`), and at the end the whole answer (:meth:`result`)."""

    def __init__(self, rid: str, model: str, created: int) -> None:
        self.rid, self.model, self.created = rid, model, created
        self.writer = ChunkWriter(rid, model, created)
        self.blocks: dict[int, dict[str, Any]] = {}
        self.stop: str | None = None
        self.usage: Mapping[str, Any] | None = None

    def add(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        if "contentBlockStart" in event:
            start = event["contentBlockStart"]
            use = (start.get("start") or {}).get("toolUse")
            if isinstance(use, Mapping):
                index = int(start.get("contentBlockIndex") or 0)
                self.blocks[index] = {"toolUse": {**use, "input": ""}}
                return self.writer.call(0, str(use["toolUseId"]), str(use["name"]), "")
            return []
        if "contentBlockDelta" in event:
            delta = event["contentBlockDelta"]
            index = int(delta.get("contentBlockIndex") or 0)
            piece = delta.get("delta") or {}
            if isinstance(piece.get("text"), str):
                block = self.blocks.setdefault(index, {"text": ""})
                block["text"] = block.get("text", "") + piece["text"]
                return self.writer.text(0, piece["text"])
            use = piece.get("toolUse")
            if isinstance(use, Mapping) and index in self.blocks:
                part = str(use.get("input") or "")
                self.blocks[index]["toolUse"]["input"] += part
                return self.writer.arguments(0, part)
            return []  # reasoning deltas: not the answer's text
        if "messageStop" in event:
            self.stop = event["messageStop"].get("stopReason")
            return self.writer.finish(0, stop_reason(self.stop))
        if "metadata" in event:
            self.usage = event["metadata"].get("usage")
        return []

    @property
    def finished(self) -> bool:
        return self.stop is not None and self.usage is not None

    def usage_chunk(self) -> dict[str, Any]:
        return self.writer.usage(answer_usage(self.usage))

    def result(self) -> dict[str, Any]:
        content = []
        for _, block in sorted(self.blocks.items()):
            if "toolUse" in block:
                raw = block["toolUse"]["input"] or "{}"
                content.append({"toolUse": {**block["toolUse"], "input": json.loads(raw)}})
            else:
                content.append(block)
        answer = {
            "output": {"message": {"role": "assistant", "content": content}},
            "stopReason": self.stop,
            "usage": self.usage,
        }
        return chat_completion(answer, self.rid, self.model, self.created)
