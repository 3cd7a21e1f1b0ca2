"""Gemini's and Bedrock's wire formats: their requests read into the chat form the
simulator answers (OpenAI's: messages, tools, ``max_tokens``), and its answers written
back in theirs.

Gemini (the Gemini API and Vertex AI): ``generateContent`` (a
``GenerateContentResponse``), ``streamGenerateContent?alt=sse`` (one server-sent
event per text piece, the finish reason and ``usageMetadata`` in the last),
``countTokens``, ``embedContent`` / ``batchEmbedContents``; errors as Google's
``{"error": {"code", "message", "status", "details"}}`` (a 429's ``RetryInfo``).

Bedrock: ``Converse`` and ``ConverseStream`` (the AWS event-stream binary framing,
:func:`event_frame`: prelude, headers, JSON payload, CRC32s); errors as
``{"__type", "message"}`` with ``x-amzn-ErrorType``.

Self-contained (the simulator is a test peer): none of batchgen's translation is
used, so a test of it against this compares two implementations.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

from batchgen.simulator.formats import BadRequest, ChatRequest
from batchgen.simulator.text import split_chunks

GEMINI_FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP"}
BEDROCK_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
EMBEDDING_DIMENSIONS = 768


# -- reading requests --------------------------------------------------------


def _get(obj: Any, name: str) -> Any:
    """A field by its REST (camelCase) or proto (snake_case) name."""
    if not isinstance(obj, Mapping):
        return None
    if name in obj:
        return obj[name]
    snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in name)
    return obj.get(snake)


def _fold_turn(
    messages: list[Any], assistant: bool, content: list[Any], calls: list[Any], results: list[Any]
) -> None:
    """One native turn's parts appended as chat messages: an assistant message (its text
    and tool calls), or the tool results it answers and then the user's own content."""
    if assistant:
        text = "".join(p["text"] for p in content if p["type"] == "text")
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        messages.append(message)
        return
    messages.extend(results)
    if content:
        messages.append({"role": "user", "content": content})


def _max_tokens(raw: Any, where: str, default: int) -> int:
    if raw is not None and (type(raw) is not int or raw < 1):
        raise BadRequest(f"{where} must be a positive integer")
    return int(raw or default)


def _function(name: Any, description: Any, parameters: Any) -> dict[str, Any]:
    """A native function declaration as an OpenAI function tool."""
    fn = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": fn}


def _gemini_parts(parts: Any, where: str) -> tuple[list[Any], list[Any], list[Any]]:
    """(content parts, tool calls, tool results) of one Gemini turn, OpenAI-shaped."""
    content: list[Any] = []
    calls: list[Any] = []
    results: list[Any] = []
    if not isinstance(parts, list) or not parts:
        raise BadRequest(f"{where}.parts must be a non-empty array", where)
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping):
            raise BadRequest(f"{where}.parts[{j}] must be an object", where)
        inline, call, result = (
            _get(part, "inlineData"),
            _get(part, "functionCall"),
            _get(part, "functionResponse"),
        )
        if isinstance(part.get("text"), str):
            content.append({"type": "text", "text": part["text"]})
        elif isinstance(inline, Mapping):
            mime, data = _get(inline, "mimeType"), inline.get("data")
            url = f"data:{mime};base64,{data}"
            content.append({"type": "image_url", "image_url": {"url": url}})
        elif isinstance(_get(part, "fileData"), Mapping):
            uri = _get(_get(part, "fileData"), "fileUri")
            content.append({"type": "image_url", "image_url": {"url": str(uri)}})
        elif isinstance(call, Mapping):
            cid = call.get("id") or f"call_{len(calls)}"
            fn = {"name": call.get("name"), "arguments": json.dumps(call.get("args") or {})}
            calls.append({"id": cid, "type": "function", "function": fn})
        elif isinstance(result, Mapping):
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": result.get("id") or str(result.get("name")),
                    "content": json.dumps(result.get("response")),
                }
            )
        else:
            raise BadRequest(f"{where}.parts[{j}]: unknown part", where)
    return content, calls, results


def parse_gemini(body: Any, model: str, stream: bool, default_max_tokens: int) -> ChatRequest:
    """A ``generateContent`` request as the chat request the simulator answers."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise BadRequest("contents must be a non-empty array", "contents")
    messages: list[Any] = []
    system = _get(body, "systemInstruction")
    if isinstance(system, Mapping):
        text = "".join(str(p.get("text") or "") for p in system.get("parts") or [])
        messages.append({"role": "system", "content": text})
    for i, turn in enumerate(contents):
        role = turn.get("role", "user") if isinstance(turn, Mapping) else None
        if role not in ("user", "model"):
            raise BadRequest(f"contents[{i}].role must be user or model", f"contents[{i}]")
        parts = _gemini_parts(turn.get("parts"), f"contents[{i}]")
        _fold_turn(messages, role == "model", *parts)
    config = _get(body, "generationConfig") or {}
    chat: dict[str, Any] = {"model": model, "messages": messages}
    declarations = [
        d for t in body.get("tools") or [] for d in _get(t, "functionDeclarations") or []
    ]
    if declarations:
        chat["tools"] = [
            _function(
                d.get("name"),
                d.get("description"),
                _get(d, "parametersJsonSchema") or d.get("parameters"),
            )
            for d in declarations
        ]
    schema = _get(config, "responseJsonSchema") or _get(config, "responseSchema")
    if schema is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": schema},
        }
    count = _get(config, "candidateCount")
    if isinstance(count, int) and count > 1:
        chat["n"] = count
    if isinstance(_get(config, "thinkingConfig"), Mapping):
        chat["reasoning_effort"] = "low"
    max_tokens = _max_tokens(
        _get(config, "maxOutputTokens"), "generationConfig.maxOutputTokens", default_max_tokens
    )
    chat["max_tokens"] = max_tokens
    tier = _get(body, "serviceTier")
    if isinstance(tier, str) and tier.lower() == "flex":
        chat["service_tier"] = "flex"
    return ChatRequest(model, messages, max_tokens, stream, True, chat)


def _bedrock_content(blocks: Any, where: str) -> tuple[list[Any], list[Any], list[Any]]:
    content: list[Any] = []
    calls: list[Any] = []
    results: list[Any] = []
    if not isinstance(blocks, list) or not blocks:
        raise BadRequest(f"{where}.content must be a non-empty list", where)
    for j, block in enumerate(blocks):
        if not isinstance(block, Mapping):
            raise BadRequest(f"{where}.content[{j}] must be an object", where)
        if isinstance(block.get("text"), str):
            content.append({"type": "text", "text": block["text"]})
        elif isinstance(block.get("image"), Mapping):
            image = block["image"]
            data = (image.get("source") or {}).get("bytes") or ""
            url = f"data:image/{image.get('format')};base64,{data}"
            content.append({"type": "image_url", "image_url": {"url": url}})
        elif isinstance(block.get("toolUse"), Mapping):
            use = block["toolUse"]
            fn = {"name": use.get("name"), "arguments": json.dumps(use.get("input") or {})}
            calls.append({"id": use.get("toolUseId"), "type": "function", "function": fn})
        elif isinstance(block.get("toolResult"), Mapping):
            result = block["toolResult"]
            text = "".join(
                str(c.get("text") if "text" in c else json.dumps(c.get("json")))
                for c in result.get("content") or []
            )
            results.append(
                {"role": "tool", "tool_call_id": result.get("toolUseId"), "content": text}
            )
        else:
            raise BadRequest(f"{where}.content[{j}]: unknown content block", where)
    return content, calls, results


def parse_bedrock(body: Any, model: str, stream: bool, default_max_tokens: int) -> ChatRequest:
    """A ``Converse`` request as the chat request the simulator answers (a
    ValidationException, as Bedrock's, for turns that do not alternate)."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise BadRequest("messages must be a non-empty list", "messages")
    messages: list[Any] = []
    system = body.get("system")
    if isinstance(system, list) and system:
        text = "".join(str(b.get("text") or "") for b in system if isinstance(b, Mapping))
        messages.append({"role": "system", "content": text})
    last = None
    for i, turn in enumerate(turns):
        role = turn.get("role") if isinstance(turn, Mapping) else None
        if role not in ("user", "assistant") or role == last or (last is None and role != "user"):
            raise BadRequest(
                "A conversation must start with a user message and alternate user and "
                "assistant turns.",
                f"messages[{i}]",
            )
        last = role
        blocks = _bedrock_content(turn.get("content"), f"messages[{i}]")
        _fold_turn(messages, role == "assistant", *blocks)
    inference = body.get("inferenceConfig") or {}
    max_tokens = _max_tokens(
        inference.get("maxTokens"), "inferenceConfig.maxTokens", default_max_tokens
    )
    chat: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    tools = [t.get("toolSpec") for t in (body.get("toolConfig") or {}).get("tools") or []]
    if tools:
        chat["tools"] = [
            _function(t.get("name"), t.get("description"), (t.get("inputSchema") or {}).get("json"))
            for t in tools
            if isinstance(t, Mapping)
        ]
        choice = (body.get("toolConfig") or {}).get("toolChoice") or {}
        chat["tool_choice"] = "required" if "any" in choice or "tool" in choice else "auto"
    structure = ((body.get("outputConfig") or {}).get("textFormat") or {}).get("structure")
    schema = (structure or {}).get("jsonSchema")
    if isinstance(schema, Mapping):
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                "name": schema.get("name") or "response",
                "schema": schema.get("schema"),
            },
        }
    return ChatRequest(model, messages, max_tokens, stream, True, chat)


# -- writing answers ---------------------------------------------------------


def _calls_of(message: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    return [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
        for c in message.get("tool_calls") or []
    ]


def gemini_usage(prompt: int, completion: int, reasoning: int) -> dict[str, Any]:
    usage = {
        "promptTokenCount": prompt,
        "candidatesTokenCount": completion - reasoning,
        "totalTokenCount": prompt + completion,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt}],
    }
    if reasoning:
        usage["thoughtsTokenCount"] = reasoning
    return usage


def gemini_response(openai: Mapping[str, Any], rid: str, model: str) -> dict[str, Any]:
    """A ``chat.completion`` (the simulator's answer) as a ``GenerateContentResponse``."""
    candidates = []
    for choice in openai["choices"]:
        message = choice["message"]
        parts: list[dict[str, Any]] = []
        if message.get("content"):
            parts.append({"text": message["content"]})
        for cid, name, args in _calls_of(message):
            parts.append({"functionCall": {"id": cid, "name": name, "args": args}})
        candidates.append(
            {
                "content": {"role": "model", "parts": parts},
                "finishReason": GEMINI_FINISH.get(choice["finish_reason"], "STOP"),
                "index": choice["index"],
            }
        )
    usage = openai["usage"]
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "candidates": candidates,
        "usageMetadata": gemini_usage(
            usage["prompt_tokens"], usage["completion_tokens"], reasoning
        ),
        "modelVersion": model,
        "responseId": rid,
    }


def gemini_stream(openai: Mapping[str, Any], rid: str, model: str) -> Iterator[dict[str, Any]]:
    """The same answer as ``streamGenerateContent`` chunks: each text piece, each call,
    then the finish reasons and usage."""
    whole = gemini_response(openai, rid, model)
    for candidate in whole["candidates"]:
        for part in candidate["content"]["parts"]:
            pieces = split_chunks(part["text"]) if "text" in part else [None]
            for piece in pieces:
                one = {"text": piece} if piece is not None else part
                yield {
                    "candidates": [
                        {"content": {"role": "model", "parts": [one]}, "index": candidate["index"]}
                    ],
                    "modelVersion": model,
                    "responseId": rid,
                }
    last = {
        "candidates": [
            {
                "content": {"role": "model", "parts": [{"text": ""}]},
                "finishReason": c["finishReason"],
                "index": c["index"],
            }
            for c in whole["candidates"]
        ],
        "usageMetadata": whole["usageMetadata"],
        "modelVersion": model,
        "responseId": rid,
    }
    yield last


def sse(data: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\r\n\r\n"


def bedrock_response(openai: Mapping[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` as a ``Converse`` result."""
    choice = openai["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"text": message["content"]})
    for cid, name, args in _calls_of(message):
        content.append({"toolUse": {"toolUseId": cid, "name": name, "input": args}})
    usage = openai["usage"]
    return {
        "output": {"message": {"role": "assistant", "content": content}},
        "stopReason": BEDROCK_STOP.get(choice["finish_reason"], "end_turn"),
        "usage": {
            "inputTokens": usage["prompt_tokens"],
            "outputTokens": usage["completion_tokens"],
            "totalTokens": usage["prompt_tokens"] + usage["completion_tokens"],
        },
        "metrics": {"latencyMs": 1},
    }


def bedrock_events(openai: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The same answer as ``ConverseStream`` events ``(event type, payload)``."""
    whole = bedrock_response(openai)
    yield "messageStart", {"role": "assistant"}
    for index, block in enumerate(whole["output"]["message"]["content"]):
        if "text" in block:
            for piece in split_chunks(block["text"]):
                delta = {"contentBlockIndex": index, "delta": {"text": piece}}
                yield "contentBlockDelta", delta
        else:
            use = block["toolUse"]
            start = {"toolUse": {"toolUseId": use["toolUseId"], "name": use["name"]}}
            yield "contentBlockStart", {"contentBlockIndex": index, "start": start}
            raw = json.dumps(use["input"])
            half = len(raw) // 2
            for part in (raw[:half], raw[half:]):
                yield (
                    "contentBlockDelta",
                    {"contentBlockIndex": index, "delta": {"toolUse": {"input": part}}},
                )
        yield "contentBlockStop", {"contentBlockIndex": index}
    yield "messageStop", {"stopReason": whole["stopReason"]}
    yield "metadata", {"usage": whole["usage"], "metrics": whole["metrics"]}


def _header(name: str, value: str) -> bytes:
    raw, data = name.encode(), value.encode()
    return bytes([len(raw)]) + raw + b"\x07" + struct.pack(">H", len(data)) + data


def event_frame(headers: Mapping[str, str], payload: bytes) -> bytes:
    """One message of the AWS event-stream encoding (as botocore's parser reads it):
    total and header lengths, the prelude's CRC32, string headers, the payload, and
    the CRC32 of the whole message."""
    head = b"".join(_header(k, v) for k, v in headers.items())
    total = 12 + len(head) + len(payload) + 4
    prelude = struct.pack(">II", total, len(head))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + head + payload
    return message + struct.pack(">I", zlib.crc32(message))


def bedrock_event(kind: str, payload: Mapping[str, Any]) -> bytes:
    headers = {":event-type": kind, ":content-type": "application/json", ":message-type": "event"}
    return event_frame(headers, json.dumps(payload, separators=(",", ":")).encode())


def embedding(text: str, dimensions: int) -> list[float]:
    """A deterministic unit-ish vector of ``text``."""
    seed = hashlib.sha256(text.encode()).digest()
    return [round((seed[i % 32] - 128) / 128, 6) for i in range(dimensions)]


def gemini_texts(body: Mapping[str, Any]) -> list[str]:
    """The texts of an ``embedContent`` (``content``) or ``batchEmbedContents``
    (``requests``) request."""
    requests = body.get("requests")
    contents = [r.get("content") for r in requests] if isinstance(requests, list) else []
    if not contents:
        contents = [body.get("content")]
    return [
        "".join(str(p.get("text") or "") for p in (c or {}).get("parts") or []) for c in contents
    ]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
