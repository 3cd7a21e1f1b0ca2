"""A provider's answer, whole: streams merged into one answer, answers replayed as streams (pure).

A streamed call is kept as the one answer its chunks make, with every field the
provider sent: each choice (``n``), its content, refusal, tool calls and logprobs
(OpenAI), or each content block, text, tool use or thinking (Anthropic), and the
usage as the provider reported it (cached and reasoning token details included).
The same answer replays as a stream whose chunks merge back into it.

Merging rules (OpenAI ``chat.completion.chunk``): string fields of a delta
(``content``, ``refusal``, a tool call's ``function.arguments``) are appended,
lists of ``logprobs`` are extended, a tool call is found by its ``index``, and any
other field takes the last value sent. Top-level fields come from the first chunk
that has them not null (``id``, ``created``, ``model``, ``system_fingerprint``,
``service_tier``); ``usage`` from the chunk that carries it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

# Top-level chunk fields that are not the answer's own: the chunk's object name, its
# choices and usage (merged on their own), and OpenAI's per-chunk padding.
_CHUNK_ONLY = frozenset({"object", "choices", "usage", "obfuscation"})


def _merge_strings(into: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        before = into.get(key)
        if isinstance(value, str) and isinstance(before, str):
            into[key] = before + value
        elif value is not None or key not in into:
            into[key] = value


def _merge_tool_calls(calls: list[dict[str, Any]], deltas: list[Any]) -> None:
    for delta in deltas:
        index = delta.get("index", len(calls))
        while len(calls) <= index:
            calls.append({})
        call = calls[index]
        for key, value in delta.items():
            if key == "index":
                continue
            if key == "function" and isinstance(value, dict):
                _merge_strings(call.setdefault("function", {}), value)
            elif value is not None or key not in call:
                call[key] = value


def _merge_logprobs(into: dict[str, Any], logprobs: dict[str, Any]) -> None:
    for key, value in logprobs.items():
        if isinstance(value, list):
            into.setdefault(key, [])
            if into[key] is None:
                into[key] = []
            into[key].extend(value)
        elif key not in into:
            into[key] = value


class OpenAIMerge:
    """The ``chat.completion`` a stream of ``chat.completion.chunk`` objects makes."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        head = self.head
        for key, value in chunk.items():
            if head.get(key) is None and key not in _CHUNK_ONLY:
                head[key] = value
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        for part in chunk.get("choices") or ():
            index = int(part.get("index", 0))
            choice = self.choices.get(index)
            if choice is None:
                choice = self.choices[index] = {
                    "index": index,
                    "message": {},
                    "logprobs": None,
                    "finish_reason": None,
                }
            delta = part.get("delta") or {}
            tool_calls = delta.get("tool_calls")
            if "tool_calls" in delta:  # merged on their own, not as a field
                delta = {k: v for k, v in delta.items() if k != "tool_calls"}
            _merge_strings(choice["message"], delta)
            if tool_calls:
                _merge_tool_calls(choice["message"].setdefault("tool_calls", []), tool_calls)
            if part.get("logprobs"):
                if choice["logprobs"] is None:
                    choice["logprobs"] = {}
                _merge_logprobs(choice["logprobs"], part["logprobs"])
            for key, value in part.items():
                if key in ("index", "delta", "logprobs"):
                    continue
                if value is not None or key not in choice:
                    choice[key] = value

    def text(self, index: int = 0) -> str:
        choice = self.choices.get(index)
        content = (choice or {}).get("message", {}).get("content")
        return content if isinstance(content, str) else ""

    def finish_reason(self, index: int = 0) -> str | None:
        reason = (self.choices.get(index) or {}).get("finish_reason")
        return reason if isinstance(reason, str) else None

    def completion(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            message = {"role": "assistant", **choice["message"]}
            message.setdefault("content", None)
            choices.append({**choice, "message": message})
        out: dict[str, Any] = {**self.head, "object": "chat.completion", "choices": choices}
        if self.usage is not None:
            out["usage"] = self.usage
        return out


def merge_openai_chunks(chunks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The ``chat.completion`` the chunks make (see the module's merging rules)."""
    merge = OpenAIMerge()
    for chunk in chunks:
        merge.add(chunk)
    return merge.completion()


def openai_chunks(completion: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    """A ``chat.completion`` as the chunks of a stream, each choice in turn: its role,
    its content and logprobs, its refusal, its tool calls (one chunk each), its finish
    reason; then the usage (when asked for). They merge back into ``completion``."""
    head = {k: v for k, v in completion.items() if k not in _CHUNK_ONLY}
    head["object"] = "chat.completion.chunk"
    for choice in completion.get("choices") or ():
        index = choice.get("index", 0)
        message = dict(choice.get("message") or {})
        tool_calls = message.pop("tool_calls", None) or []
        content, refusal = message.get("content"), message.get("refusal")
        # The role first (as providers send it), then the text with its logprobs.
        first = {**message, "content": "" if isinstance(content, str) else content}
        if isinstance(refusal, str):
            first["refusal"] = None
        yield {**head, "choices": [{"index": index, "delta": first, "finish_reason": None}]}
        logprobs = choice.get("logprobs")
        if content or logprobs:
            delta = {"content": content} if content else {}
            part = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            yield {**head, "choices": [part]}
        if isinstance(refusal, str):
            delta = {"refusal": refusal}
            yield {**head, "choices": [{"index": index, "delta": delta, "finish_reason": None}]}
        for i, call in enumerate(tool_calls):
            delta = {"tool_calls": [{"index": i, **call}]}
            yield {**head, "choices": [{"index": index, "delta": delta, "finish_reason": None}]}
        rest = {k: v for k, v in choice.items() if k not in ("index", "message", "logprobs")}
        yield {**head, "choices": [{"index": index, "delta": {}, **rest}]}
    if include_usage:
        yield {**head, "choices": [], "usage": completion.get("usage")}


# --- Anthropic Messages ----------------------------------------------------------


class AnthropicMerge:
    """The ``Message`` a Messages stream's events make (``content_block_*`` deltas
    appended per block: text, tool input JSON, thinking and its signature)."""

    def __init__(self) -> None:
        self.message: dict[str, Any] | None = None
        self.blocks: dict[int, dict[str, Any]] = {}
        self.partial_json: dict[int, str] = {}
        self.stopped = False

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start":
            self.message = dict(event["message"])
            self.message["usage"] = dict(self.message.get("usage") or {})
        elif kind == "content_block_start":
            self.blocks[int(event["index"])] = dict(event["content_block"])
        elif kind == "content_block_delta":
            self._delta(int(event["index"]), event["delta"])
        elif kind == "content_block_stop":
            index = int(event["index"])
            if index in self.partial_json:
                raw = self.partial_json.pop(index)
                self.blocks[index]["input"] = json.loads(raw) if raw else {}
        elif kind == "message_delta" and self.message is not None:
            self.message.update(event.get("delta") or {})
            usage = {k: v for k, v in (event.get("usage") or {}).items() if v is not None}
            self.message["usage"].update(usage)
        elif kind == "message_stop":
            self.stopped = True

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        block = self.blocks.setdefault(index, {})
        kind = delta.get("type")
        if kind == "input_json_delta":
            self.partial_json[index] = self.partial_json.get(index, "") + delta["partial_json"]
            return
        field = {"text_delta": "text", "thinking_delta": "thinking"}.get(kind or "")
        if kind == "signature_delta":
            field = "signature"
        if field is None:  # a delta type this code does not know: kept as it is
            block.setdefault("deltas", []).append(delta)
            return
        block[field] = (block.get(field) or "") + delta[field]

    def text(self) -> str:
        return "".join(b.get("text", "") for b in self.blocks.values() if b.get("type") == "text")

    def result(self) -> dict[str, Any] | None:
        if self.message is None:
            return None
        return {**self.message, "content": [self.blocks[i] for i in sorted(self.blocks)]}


def anthropic_events(message: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A ``Message`` as the ``(event, data)`` pairs of a Messages stream (they merge
    back into ``message``): each block whole at its start but for its growing field
    (text, thinking, tool input), sent as one delta."""
    usage = dict(message.get("usage") or {})
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**usage, "output_tokens": 0}
    yield "message_start", {"type": "message_start", "message": start}
    for index, block in enumerate(message.get("content") or ()):
        kind = block.get("type")
        shell, delta = dict(block), None
        if kind == "text":
            shell["text"], delta = "", {"type": "text_delta", "text": block.get("text", "")}
        elif kind == "thinking":
            shell["thinking"] = ""
            delta = {"type": "thinking_delta", "thinking": block.get("thinking", "")}
        elif kind == "tool_use":
            shell["input"] = {}
            partial = json.dumps(block.get("input", {}), ensure_ascii=False)
            delta = {"type": "input_json_delta", "partial_json": partial}
        deltas = [delta] if delta is not None else []
        if kind == "thinking" and "signature" in block:
            shell["signature"] = ""
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        start_block = {"type": "content_block_start", "index": index, "content_block": shell}
        yield "content_block_start", start_block
        for each in deltas:
            yield (
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": each},
            )
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    end = {
        "type": "message_delta",
        "delta": {
            "stop_reason": message.get("stop_reason"),
            "stop_sequence": message.get("stop_sequence"),
        },
        "usage": usage,
    }
    yield "message_delta", end
    yield "message_stop", {"type": "message_stop"}
