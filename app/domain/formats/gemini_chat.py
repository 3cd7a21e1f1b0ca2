"""An OpenAI chat body as a Gemini ``generateContent`` request, and its answer (plain
or streamed) as a ``chat.completion`` (pure). Vertex AI takes the same request.

The request is the ``google-genai`` SDK's arguments in its field names (``contents``
and a ``config``); the answer is the SDK's ``GenerateContentResponse`` as a dict of
the same names (``model_dump(mode="json")``) or the REST form (camelCase): both are
read.

Usage: ``prompt_tokens`` is Gemini's ``promptTokenCount`` plus its tool-use prompt
tokens, ``completion_tokens`` the candidates' tokens plus the thinking tokens
(``thoughtsTokenCount``, also reported as ``reasoning_tokens``, as OpenAI counts
reasoning), ``cached_tokens`` its ``cachedContentTokenCount``.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from batchgen.domain.formats.chat import (
    GEMINI,
    THINKING_BUDGETS,
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

FLEX_TIER = "flex"
FINISH_REASONS = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
    "IMAGE_PROHIBITED_CONTENT": "content_filter",
    "LANGUAGE": "stop",
    "OTHER": "stop",
    "MALFORMED_FUNCTION_CALL": "stop",
    "UNEXPECTED_TOOL_CALL": "stop",
}


def _get(obj: Mapping[str, Any] | None, snake: str) -> Any:
    """A field by its SDK (snake_case) or REST (camelCase) name."""
    if not isinstance(obj, Mapping):
        return None
    if snake in obj:
        return obj[snake]
    head, *rest = snake.split("_")
    return obj.get(head + "".join(w.title() for w in rest))


def _part(part: Part) -> dict[str, Any]:
    if isinstance(part, str):
        return {"text": part}
    if isinstance(part, Image):
        if part.uri is not None:
            return {"file_data": {"file_uri": part.uri, "mime_type": part.mime}}
        return {"inline_data": {"mime_type": part.mime, "data": part.data}}
    if isinstance(part, ToolCall):
        return {"function_call": {"id": part.id, "name": part.name, "args": part.arguments}}
    assert isinstance(part, ToolResult)
    try:
        result = json.loads(part.text)
    except json.JSONDecodeError:
        result = part.text
    response = result if isinstance(result, dict) else {"result": result}
    return {"function_response": {"id": part.id, "name": part.name, "response": response}}


def request(body: Mapping[str, Any], kind: str, max_tokens: int) -> dict[str, Any]:
    """``{"contents": ..., "config": ...}`` of the request ``body`` asks for (raises
    :class:`~batchgen.domain.formats.chat.Untranslatable`); ``max_tokens`` bounds the
    output when the body does not. A body that says ``service_tier: "flex"`` (a flex
    call, :func:`batchgen.domain.scheduling.routes.with_service_tier`) asks the Gemini API's flex
    tier."""
    params = from_chat(parse_chat(body, kind), max_tokens)
    if kind == GEMINI and body.get("service_tier") == FLEX_TIER:
        params["config"]["service_tier"] = FLEX_TIER
    return params


def is_flex(params: Mapping[str, Any]) -> bool:
    """The request (:func:`request`'s) asks the flex tier."""
    return bool((params.get("config") or {}).get("service_tier") == FLEX_TIER)


def from_chat(chat: Chat, max_tokens: int) -> dict[str, Any]:
    contents = [
        {"role": "model" if t.role == "assistant" else "user", "parts": [_part(p) for p in t.parts]}
        for t in chat.turns
    ]
    config: dict[str, Any] = {"max_output_tokens": chat.max_tokens or max_tokens}
    if chat.system:
        config["system_instruction"] = {"parts": [{"text": s} for s in chat.system]}
    for key in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        value = getattr(chat, key)
        if value is not None:
            config[key] = value
    if chat.stop:
        config["stop_sequences"] = chat.stop
    if chat.n > 1:
        config["candidate_count"] = chat.n
    if chat.json_mode:
        config["response_mime_type"] = "application/json"
    if chat.json_schema is not None:
        config["response_json_schema"] = chat.json_schema
    if chat.tools:
        declarations = []
        for tool in chat.tools:
            declaration: dict[str, Any] = {"name": tool.name}
            if tool.description:
                declaration["description"] = tool.description
            if tool.parameters is not None:
                declaration["parameters_json_schema"] = tool.parameters
            declarations.append(declaration)
        config["tools"] = [{"function_declarations": declarations}]
    if chat.tool_choice is not None:
        mode = {"auto": "AUTO", "none": "NONE", "required": "ANY"}[chat.tool_choice]
        calling: dict[str, Any] = {"mode": mode}
        if chat.forced_tool:
            calling["allowed_function_names"] = [chat.forced_tool]
        config["tool_config"] = {"function_calling_config": calling}
    if chat.reasoning_effort is not None:
        config["thinking_config"] = {"thinking_budget": THINKING_BUDGETS[chat.reasoning_effort]}
    return {"contents": contents, "config": config}


def finish_reason(reason: Any, called: bool) -> str | None:
    if reason is None:
        return None
    if called and reason == "STOP":
        return "tool_calls"
    return FINISH_REASONS.get(str(reason), "stop")


def call_id(response_id: str, index: int, n: int, call: Mapping[str, Any]) -> str:
    """The call's own id, else one made from the answer's id (stable across reads)."""
    own = call.get("id")
    if isinstance(own, str) and own:
        return own
    digest = hashlib.sha256(f"{response_id}:{index}:{n}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def answer_usage(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The answer's ``usageMetadata`` as an OpenAI ``usage``."""
    prompt = int(_get(meta, "prompt_token_count") or 0)
    prompt += int(_get(meta, "tool_use_prompt_token_count") or 0)
    thoughts = int(_get(meta, "thoughts_token_count") or 0)
    done = int(_get(meta, "candidates_token_count") or 0) + thoughts
    cached = int(_get(meta, "cached_content_token_count") or 0)
    return usage(prompt, done, cached=cached, reasoning=thoughts)


def _choice(response_id: str, candidate: Mapping[str, Any], position: int) -> dict[str, Any]:
    index = _get(candidate, "index")
    index = index if isinstance(index, int) else position
    parts = (_get(candidate, "content") or {}).get("parts") or []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in parts:
        if part.get("thought"):
            continue  # a thought summary: not the answer
        text = part.get("text")
        if isinstance(text, str):
            texts.append(text)
        call = _get(part, "function_call")
        if isinstance(call, Mapping):
            cid = call_id(response_id, index, len(calls), call)
            calls.append(tool_call(cid, str(call.get("name")), call.get("args") or {}))
    finish = finish_reason(_get(candidate, "finish_reason"), bool(calls))
    return {"index": index, "message": message("".join(texts), calls), "finish_reason": finish}


def chat_completion(
    answer: Mapping[str, Any], model: str, created: int, rid: str | None = None
) -> dict[str, Any]:
    """A ``GenerateContentResponse`` as a ``chat.completion``; raises ``KeyError`` when
    it carries no usage (a malformed answer). A prompt blocked outright (no candidate)
    is one empty choice finished ``content_filter``."""
    meta = _get(answer, "usage_metadata")
    if not isinstance(meta, Mapping):
        raise KeyError("usage_metadata")
    response_id = rid or str(_get(answer, "response_id") or "")
    candidates = _get(answer, "candidates") or []
    choices = [_choice(response_id, c, i) for i, c in enumerate(candidates)]
    if not choices:
        choices = [{"index": 0, "message": message("", []), "finish_reason": "content_filter"}]
    name = str(_get(answer, "model_version") or model)
    return completion(response_id, name, created, choices, answer_usage(meta))


class StreamMerge:
    """A ``streamGenerateContent`` stream: each chunk as the ``chat.completion.chunk``
    objects it makes (:meth:`add`), and at the end the whole answer (:meth:`result`),
    the chunks' parts joined as one ``GenerateContentResponse``."""

    def __init__(self, model: str, created: int) -> None:
        self.model, self.created = model, created
        self.parts: dict[int, list[dict[str, Any]]] = {}
        self.finish: dict[int, Any] = {}
        self.meta: Mapping[str, Any] | None = None
        self.response_id = ""
        self.version: str | None = None
        self.writer: ChunkWriter | None = None

    def add(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.response_id = self.response_id or str(_get(chunk, "response_id") or "")
        self.version = self.version or _get(chunk, "model_version")
        meta = _get(chunk, "usage_metadata")
        if isinstance(meta, Mapping):
            self.meta = meta
        if self.writer is None:
            self.writer = ChunkWriter(self.response_id, self.version or self.model, self.created)
        out: list[dict[str, Any]] = []
        for position, candidate in enumerate(_get(chunk, "candidates") or []):
            index = _get(candidate, "index")
            index = index if isinstance(index, int) else position
            kept = self.parts.setdefault(index, [])
            for part in (_get(candidate, "content") or {}).get("parts") or []:
                kept.append(part)
                if part.get("thought"):
                    continue
                if isinstance(part.get("text"), str):
                    out += self.writer.text(index, part["text"])
                call = _get(part, "function_call")
                if isinstance(call, Mapping):
                    n = self.writer.calls.get(index, 0)
                    cid = call_id(self.response_id, index, n, call)
                    args = json.dumps(call.get("args") or {})
                    out += self.writer.call(index, cid, str(call.get("name")), args)
            reason = _get(candidate, "finish_reason")
            if reason is not None:
                self.finish[index] = reason
                called = any(_get(p, "function_call") for p in kept)
                out += self.writer.finish(index, finish_reason(reason, called))
        return out

    @property
    def finished(self) -> bool:
        return bool(self.finish) and self.meta is not None

    def usage_chunk(self) -> dict[str, Any]:
        writer = self.writer or ChunkWriter(self.response_id, self.model, self.created)
        return writer.usage(answer_usage(self.meta))

    def result(self) -> dict[str, Any]:
        """The whole answer as a ``chat.completion`` (its chunks' id and model)."""
        candidates = [
            {"index": i, "content": {"parts": parts}, "finish_reason": self.finish.get(i)}
            for i, parts in sorted(self.parts.items())
        ]
        answer = {
            "response_id": self.response_id,
            "model_version": self.version or self.model,
            "candidates": candidates,
            "usage_metadata": self.meta,
        }
        return chat_completion(answer, self.model, self.created)


RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"


def retry_delay_s(error: Any) -> float | None:
    """The ``RetryInfo`` delay of a Google API error body (``"7s"``, ``"0.5s"``)."""
    if isinstance(error, Mapping) and isinstance(error.get("error"), Mapping):
        error = error["error"]
    details = error.get("details") if isinstance(error, Mapping) else None
    for detail in details if isinstance(details, list) else []:
        if isinstance(detail, Mapping) and detail.get("@type") == RETRY_INFO:
            delay = detail.get("retryDelay")
            if isinstance(delay, str) and delay.endswith("s"):
                try:
                    return max(0.0, float(delay[:-1]))
                except ValueError:
                    return None
    return None


# The config fields that are the request's own in the REST form (the rest are its
# generationConfig), and the fields whose values are JSON schemas (kept as they are).
_REQUEST_FIELDS = ("system_instruction", "tools", "tool_config")
_SCHEMA_FIELDS = frozenset({"parameters_json_schema", "response_json_schema", "args", "response"})


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


def _rest(value: Any, key: str = "") -> Any:
    """A value of the SDK form in the REST form: camelCase keys, bytes as base64;
    schemas, function arguments and responses as they are."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if key in _SCHEMA_FIELDS:
        return value
    if isinstance(value, Mapping):
        return {_camel(k): _rest(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_rest(v) for v in value]
    return value


def rest_request(
    body: Mapping[str, Any], kind: str, max_tokens: int, labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The ``GenerateContentRequest`` of ``body`` in its REST (JSON) form, as a Vertex AI
    batch prediction's input line carries it (``labels``: Vertex AI's request labels).
    A batch job's line asks no service tier (its price is the batch one)."""
    sdk = request(body, kind, max_tokens)
    config = dict(sdk["config"])
    config.pop("service_tier", None)
    out: dict[str, Any] = {"contents": _rest(sdk["contents"])}
    for name in _REQUEST_FIELDS:
        if name in config:
            out[_camel(name)] = _rest(config.pop(name), name)
    out["generationConfig"] = _rest(config)
    if labels:
        out["labels"] = dict(labels)
    return out
