"""An OpenAI chat body as the parts the native formats share, or a refusal naming the
field no native format of the provider kind can take (pure).

Read: ``system`` and ``developer`` messages (the system prompt), ``user`` and
``assistant`` turns of text and images (a ``data:`` URL; Vertex AI also takes a
``gs://`` URI), an assistant's ``tool_calls`` and the ``tool`` messages answering
them, ``tools`` (functions), ``tool_choice``, ``response_format`` (``json_schema``,
``json_object``), ``max_completion_tokens`` / ``max_tokens``, ``temperature``,
``top_p``, ``stop``, and where the kind has them ``n``, ``seed``, the penalties and
``reasoning_effort``. Fields that only shape OpenAI's own service (``user``,
``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``, ``stream_options``)
are left out. Anything else is refused, so that no request is sent without a part of
what it asked for.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GEMINI, VERTEX, BEDROCK = "gemini", "vertex", "bedrock"
NATIVE_KINDS = frozenset({GEMINI, VERTEX, BEDROCK})

# Read by this module (the body's own fields).
_READ = frozenset(
    {
        "model",
        "messages",
        "tools",
        "tool_choice",
        "response_format",
        "max_completion_tokens",
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "n",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "reasoning_effort",
    }
)
# OpenAI service options with no meaning for the answer: left out.
_IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "stream",
        "stream_options",
        "anthropic_params",
    }
)
# What each kind has no field for (besides what every kind refuses: the rest).
_NOT_ON = {
    BEDROCK: ("seed", "presence_penalty", "frequency_penalty", "reasoning_effort"),
    GEMINI: (),
    VERTEX: (),
}
IMAGE_FORMATS = {"image/png": "png", "image/jpeg": "jpeg", "image/gif": "gif", "image/webp": "webp"}
# Gemini's thinking budget for OpenAI's reasoning_effort.
THINKING_BUDGETS = {"minimal": 128, "low": 1024, "medium": 8192, "high": 24576}


class Untranslatable(Exception):
    """A request a provider kind's native format cannot carry; ``field`` is its path
    in the batch line (``body.messages[1].content[0].type``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Image:
    mime: str
    data: bytes | None = None  # inline bytes (a data: URL)
    uri: str | None = None  # a gs:// URI (Vertex AI)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    id: str
    name: str
    text: str


Part = str | Image | ToolCall | ToolResult


@dataclass
class Turn:
    role: str  # "user" or "assistant"
    parts: list[Part] = field(default_factory=list)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None


@dataclass
class Chat:
    """What an OpenAI chat body asks for, in the parts every native format has."""

    system: list[str]
    turns: list[Turn]
    tools: list[Tool] = field(default_factory=list)
    # "auto", "none", "required", or the one function's name (forced).
    tool_choice: str | None = None
    forced_tool: str | None = None
    json_schema: dict[str, Any] | None = None
    schema_name: str | None = None
    json_mode: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    reasoning_effort: str | None = None


def refusal(body: Mapping[str, Any], kind: str) -> Untranslatable | None:
    """Why ``body`` cannot go to a provider of ``kind`` (the field and the reason), or
    None when it translates whole."""
    try:
        parse_chat(body, kind)
    except Untranslatable as exc:
        return exc
    return None


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Untranslatable(f"body.{key}", "must be a number")
    return float(value)


def parse_chat(body: Mapping[str, Any], kind: str) -> Chat:
    """``body`` (an OpenAI chat request) as a :class:`Chat`; raises
    :class:`Untranslatable` for what ``kind``'s format cannot carry."""
    for key in body:
        if key in _NOT_ON.get(kind, ()) and body[key] is not None:
            raise Untranslatable(f"body.{key}", f"has no equivalent on a {kind} model")
        if key not in _READ and key not in _IGNORED and body[key] is not None:
            raise Untranslatable(f"body.{key}", f"has no equivalent on a {kind} model")
    system, turns = _messages(body.get("messages"), kind)
    chat = Chat(system=system, turns=turns)
    chat.tools = _tools(body.get("tools"))
    _tool_choice(chat, body.get("tool_choice"), kind)
    _response_format(chat, body.get("response_format"), kind)
    given = [body.get(k) for k in ("max_completion_tokens", "max_tokens")]
    numbers = [v for v in given if isinstance(v, int) and not isinstance(v, bool)]
    chat.max_tokens = max(numbers) if numbers else None
    chat.temperature = _number(body, "temperature")
    chat.top_p = _number(body, "top_p")
    chat.presence_penalty = _number(body, "presence_penalty")
    chat.frequency_penalty = _number(body, "frequency_penalty")
    stop = body.get("stop")
    if isinstance(stop, str):
        chat.stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        chat.stop = list(stop)
    elif stop is not None:
        raise Untranslatable("body.stop", "must be a string or a list of strings")
    n = body.get("n")
    if n is not None and n != 1:
        if kind == BEDROCK:
            raise Untranslatable("body.n", "a bedrock model answers one choice (n = 1)")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise Untranslatable("body.n", "must be a positive integer")
        chat.n = n
    seed = body.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise Untranslatable("body.seed", "must be an integer")
        chat.seed = seed
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in THINKING_BUDGETS:
            raise Untranslatable(
                "body.reasoning_effort", f"must be one of {', '.join(THINKING_BUDGETS)}"
            )
        chat.reasoning_effort = effort
    return chat


def _text_of(content: Any, where: str) -> str:
    """A system or tool message's content as text (a string or text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise Untranslatable(f"{where}[{j}].type", "only text parts are taken here")
            texts.append(str(part.get("text") or ""))
        return "".join(texts)
    if content is None:
        return ""
    raise Untranslatable(where, "must be a string or a list of parts")


def _image(part: Mapping[str, Any], where: str, kind: str) -> Image:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    if not isinstance(url, str):
        raise Untranslatable(f"{where}.image_url.url", "is required")
    if url.startswith("data:"):
        head, _, data = url[5:].partition(",")
        mime, _, encoding = head.partition(";")
        if encoding != "base64":
            raise Untranslatable(f"{where}.image_url.url", "a data: URL must be base64")
        if mime not in IMAGE_FORMATS:
            raise Untranslatable(
                f"{where}.image_url.url", f"{mime or 'no'} image type: png, jpeg, gif or webp"
            )
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise Untranslatable(f"{where}.image_url.url", "is not valid base64") from None
        return Image(mime, data=raw)
    if kind == VERTEX and url.startswith("gs://"):
        ext = url.rsplit(".", 1)[-1].lower()
        mime = {"jpg": "image/jpeg", "jpeg": "image/jpeg"}.get(ext, f"image/{ext}")
        if mime not in IMAGE_FORMATS:
            raise Untranslatable(f"{where}.image_url.url", "png, jpeg, gif or webp")
        return Image(mime, uri=url)
    takes = "a data: URL or a gs:// URI" if kind == VERTEX else "a data: URL (base64)"
    raise Untranslatable(f"{where}.image_url.url", f"a {kind} model takes images as {takes}")


def _user_parts(content: Any, where: str, kind: str) -> list[Part]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise Untranslatable(where, "must be a string or a list of parts")
    parts: list[Part] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind_of = part.get("type") if isinstance(part, Mapping) else None
        if kind_of == "text":
            parts.append(str(part.get("text") or ""))
        elif kind_of == "image_url":
            parts.append(_image(part, at, kind))
        else:
            raise Untranslatable(f"{at}.type", f"{kind_of!r} parts have no {kind} equivalent")
    return parts


def _tool_calls(calls: Any, where: str) -> list[ToolCall]:
    if not isinstance(calls, list):
        raise Untranslatable(where, "must be a list")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, Mapping) or call.get("type", "function") != "function":
            raise Untranslatable(f"{at}.type", "only function calls are taken")
        fn = call.get("function") or {}
        name, raw = fn.get("name"), fn.get("arguments") or "{}"
        if not isinstance(name, str) or not isinstance(call.get("id"), str):
            raise Untranslatable(at, "needs an id and a function name")
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError:
            raise Untranslatable(f"{at}.function.arguments", "is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise Untranslatable(f"{at}.function.arguments", "must be a JSON object")
        out.append(ToolCall(call["id"], name, arguments))
    return out


def _messages(messages: Any, kind: str) -> tuple[list[str], list[Turn]]:
    if not isinstance(messages, list) or not messages:
        raise Untranslatable("body.messages", "must be a non-empty list")
    system: list[str] = []
    turns: list[Turn] = []
    names: dict[str, str] = {}  # tool call id -> function name

    def add(role: str, parts: list[Part]) -> None:
        if turns and turns[-1].role == role:  # the native formats alternate turns
            turns[-1].parts.extend(parts)
        else:
            turns.append(Turn(role, parts))

    for i, message in enumerate(messages):
        where = f"body.messages[{i}]"
        role = message.get("role") if isinstance(message, Mapping) else None
        content = message.get("content") if isinstance(message, Mapping) else None
        if role in ("system", "developer"):
            if turns:
                raise Untranslatable(
                    f"{where}.role", f"a {kind} model takes system text before the turns only"
                )
            system.append(_text_of(content, f"{where}.content"))
        elif role == "user":
            add("user", _user_parts(content, f"{where}.content", kind))
        elif role == "assistant":
            parts: list[Part] = []
            if content is not None:
                parts.extend(_user_parts(content, f"{where}.content", kind))
            parts = [p for p in parts if not isinstance(p, str) or p]
            calls = _tool_calls(message.get("tool_calls") or [], f"{where}.tool_calls")
            names.update({c.id: c.name for c in calls})
            add("assistant", [*parts, *calls])
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in names:
                raise Untranslatable(
                    f"{where}.tool_call_id", "must name a tool call of an earlier message"
                )
            text = _text_of(content, f"{where}.content")
            add("user", [ToolResult(call_id, names[call_id], text)])
        else:
            raise Untranslatable(f"{where}.role", f"{role!r} has no {kind} equivalent")
    if not turns:
        raise Untranslatable("body.messages", "needs a user message")
    if kind == BEDROCK and turns[0].role != "user":
        raise Untranslatable("body.messages", "a bedrock conversation starts with a user turn")
    return system, turns


def _tools(tools: Any) -> list[Tool]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise Untranslatable("body.tools", "must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise Untranslatable(f"body.tools[{i}].type", "only function tools are taken")
        fn = tool.get("function") or {}
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise Untranslatable(f"body.tools[{i}].function.name", "is required")
        params = fn.get("parameters")
        out.append(Tool(name, fn.get("description"), params if isinstance(params, dict) else None))
    return out


def _tool_choice(chat: Chat, choice: Any, kind: str) -> None:
    if choice is None:
        return
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise Untranslatable("body.tool_choice", "must name a function")
        chat.tool_choice, chat.forced_tool = "required", name
        return
    if choice not in ("auto", "none", "required"):
        raise Untranslatable("body.tool_choice", "must be auto, none, required or a function")
    if choice == "none" and kind == BEDROCK and chat.tools:
        raise Untranslatable("body.tool_choice", "'none' has no bedrock equivalent")
    chat.tool_choice = choice


def _response_format(chat: Chat, fmt: Any, kind: str) -> None:
    if fmt is None:
        return
    kind_of = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind_of == "text":
        return
    if kind_of == "json_object":
        if kind == BEDROCK:
            raise Untranslatable(
                "body.response_format.type", "a bedrock model takes a json_schema, not json_object"
            )
        chat.json_mode = True
        return
    if kind_of == "json_schema":
        spec = fmt.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, dict):
            raise Untranslatable("body.response_format.json_schema.schema", "is required")
        chat.json_mode, chat.json_schema = True, schema
        chat.schema_name = spec.get("name") if isinstance(spec.get("name"), str) else None
        return
    raise Untranslatable("body.response_format.type", f"{kind_of!r} has no {kind} equivalent")


def usage(
    prompt: int,
    completion: int,
    *,
    cached: int = 0,
    cache_write: int = 0,
    reasoning: int = 0,
) -> dict[str, Any]:
    """An OpenAI ``usage`` object: ``prompt`` counts every input token (cached and
    written ones too), ``completion`` every output token (reasoning ones too)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }
    if cache_write:
        out["cache_creation_input_tokens"] = cache_write
    return out


def completion(
    rid: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_: dict[str, Any],
) -> dict[str, Any]:
    """A ``chat.completion`` of ``choices`` (each ``{index, message, finish_reason}``)."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def message(text: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """An assistant message: its text (None when it only calls tools) and tool calls."""
    out: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        out["tool_calls"] = calls
    return out


def tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


class ChunkWriter:
    """``chat.completion.chunk`` objects of one answer, in OpenAI's order: a role delta
    per choice, text and tool-call deltas, a finish reason per choice, then usage."""

    def __init__(self, rid: str, model: str, created: int) -> None:
        self.head = {"id": rid, "object": "chat.completion.chunk", "created": created}
        self.model = model
        self.started: set[int] = set()
        self.calls: dict[int, int] = {}  # choice index -> tool calls sent

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None) -> Any:
        choice = {"index": index, "delta": delta, "finish_reason": finish}
        return {**self.head, "model": self.model, "choices": [choice]}

    def _start(self, index: int) -> list[dict[str, Any]]:
        if index in self.started:
            return []
        self.started.add(index)
        return [self._chunk(index, {"role": "assistant", "content": ""})]

    def text(self, index: int, text: str) -> list[dict[str, Any]]:
        return [*self._start(index), self._chunk(index, {"content": text})] if text else []

    def call(self, index: int, call_id: str, name: str, arguments: str) -> list[dict[str, Any]]:
        n = self.calls.get(index, 0)
        self.calls[index] = n + 1
        delta = {"index": n, "id": call_id, "type": "function"}
        delta["function"] = {"name": name, "arguments": arguments}
        return [*self._start(index), self._chunk(index, {"tool_calls": [delta]})]

    def arguments(self, index: int, piece: str) -> list[dict[str, Any]]:
        n = self.calls.get(index, 1) - 1
        delta = {"tool_calls": [{"index": n, "function": {"arguments": piece}}]}
        return [self._chunk(index, delta)] if piece else []

    def finish(self, index: int, reason: str | None) -> list[dict[str, Any]]:
        return [*self._start(index), self._chunk(index, {}, reason)]

    def usage(self, usage_: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "model": self.model, "choices": [], "usage": usage_}
