"""The simulator's Responses API and embeddings: request parsing, prompt counting and
the answers, deterministic like its chat answers.

``POST /v1/responses``: the answer to the request's ``instructions`` and ``input``
(read as chat messages: the same deterministic text a chat request with those
messages gets, bounded by ``max_output_tokens``) as a ``Response`` object: a
``reasoning`` item for a reasoning model (or ``reasoning.effort``), a
``function_call`` of the first function tool when ``tools`` are given, else a
``message`` with one ``output_text``; ``usage`` with ``input_tokens`` (and
``input_tokens_details.cached_tokens``, a repeated prefix as for chat),
``output_tokens`` (and ``output_tokens_details.reasoning_tokens``). Item ids derive
from the prompt's digest, so two calls with one prompt differ only in ``id`` and
``created_at``.

``POST /v1/embeddings``: one unit vector per input, drawn from a generator seeded by
the model and the input, of the model's length (:data:`DIMENSIONS`, else
:data:`DEFAULT_DIMENSIONS`; ``dimensions`` shortens it), as floats or, with
``encoding_format: base64``, as little-endian float32 bytes in base64 (what the
``openai`` SDK asks for); ``usage.prompt_tokens`` counts the inputs' text (a token-id
input by its length).

Self-contained like the rest of the simulator: no batchgen code but the token counter.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import random
import re
import secrets
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

from batchgen.domain.formats.tokens import count_text
from batchgen.simulator import counting
from batchgen.simulator.formats import BadRequest, ChatRequest
from batchgen.simulator.text import request_digest

DIMENSIONS = {
    "text-embedding-3-small": 1536,
    "text-embedding-3-large": 3072,
    "text-embedding-ada-002": 1536,
}
DEFAULT_DIMENSIONS = 1536
_REASONING_MODEL = re.compile(r"^o\d|reason", re.IGNORECASE)
_TEXT_PARTS = ("input_text", "output_text")


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("Missing required parameter: 'model'.", param="model")
    return model


# --- /v1/responses --------------------------------------------------------------------


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(12)


def _content(content: Any) -> Any:
    """An input message's content as chat content (text parts as text, images kept)."""
    if not isinstance(content, list):
        return content
    out: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, Mapping):
            continue
        if part.get("type") in _TEXT_PARTS:
            out.append({"type": "text", "text": part.get("text") or ""})
        elif part.get("type") == "input_image":
            url = {"url": part.get("image_url") or "", "detail": part.get("detail") or "auto"}
            out.append({"type": "image_url", "image_url": url})
    return out


def input_messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """``instructions`` and ``input`` as the chat messages they are read (and counted) as."""
    messages: list[Mapping[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "developer", "content": body["instructions"]})
    value = body.get("input")
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    for item in value if isinstance(value, list) else []:
        if not isinstance(item, Mapping):
            continue
        if "role" in item:
            messages.append({"role": item["role"], "content": _content(item.get("content"))})
        elif item.get("type") == "function_call":
            messages.append(
                {"role": "assistant", "name": item.get("name"), "content": item.get("arguments")}
            )
        elif item.get("type") == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "content": text})
        else:
            rest = {k: v for k, v in item.items() if k not in ("type", "id", "status")}
            messages.append({"role": str(item.get("type")), "content": json.dumps(rest)})
    return messages


def parse_responses(body: Any, default_max_tokens: int) -> ChatRequest:
    """Validate a Responses request; raise :class:`BadRequest` as the API would."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    model = _model(body)
    value = body.get("input")
    if not (isinstance(value, str) and value) and not (isinstance(value, list) and value):
        raise BadRequest("'input' must be a non-empty string or array of items", param="input")
    if body.get("stream"):
        raise BadRequest("streaming is not simulated on /v1/responses", param="stream")
    raw = body.get("max_output_tokens")
    if raw is not None and (type(raw) is not int or raw < 1):
        raise BadRequest("'max_output_tokens' must be an integer >= 1", "max_output_tokens")
    max_tokens = default_max_tokens if raw is None else raw
    return ChatRequest(model, input_messages(body), max_tokens, False, False, body)


def function_tools(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The request's function tools (built-in tools have no schema in the prompt)."""
    tools = body.get("tools")
    return [
        t
        for t in (tools if isinstance(tools, list) else ())
        if isinstance(t, Mapping) and t.get("type") == "function"
    ]


def responses_prompt_tokens(
    body: Mapping[str, Any], messages: list[Mapping[str, Any]], encoding: str
) -> int:
    """The Response's input tokens, counted as OpenAI counts a chat prompt with the same
    messages, its function tools and a json_schema text format."""
    tools = [
        t for t in body.get("tools") or () if isinstance(t, Mapping) and t.get("type") == "function"
    ]
    as_chat: dict[str, Any] = {"tools": tools}
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        as_chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")},
        }
    return counting.prompt_tokens("openai", as_chat, messages, encoding)


def wants_reasoning(body: Mapping[str, Any], model: str) -> bool:
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    return bool(_REASONING_MODEL.search(model) or effort)


def _output(
    body: Mapping[str, Any], digest: str, text: str, reasoning: bool
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if reasoning:
        out.append({"id": f"rs_{digest}", "type": "reasoning", "summary": []})
    tools = [
        t for t in body.get("tools") or () if isinstance(t, Mapping) and t.get("type") == "function"
    ]
    if tools:
        out.append(
            {
                "id": f"fc_{digest}",
                "type": "function_call",
                "status": "completed",
                "arguments": json.dumps({"query": digest}),
                "call_id": f"call_{digest}",
                "name": str(tools[0].get("name") or "tool"),
            }
        )
        return out
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    out.append(
        {
            "id": f"msg_{digest}",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }
    )
    return out


def response_object(
    rid: str,
    req: ChatRequest,
    answer: tuple[str, int, str],
    prompt_tokens: int,
    cached_tokens: int,
) -> dict[str, Any]:
    """The ``Response`` to a Responses request (its text from ``answer``)."""
    body, model = req.body, req.model
    text, ctoks, finish = answer
    reasoning = wants_reasoning(body, model)
    reasoning_tokens = min(ctoks, max(1, ctoks // 2)) if reasoning else 0
    cut = finish == "length"
    tools = body.get("tools")
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": _output(body, request_digest(req.prompt_messages), text, reasoning),
        "parallel_tool_calls": True,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
        "service_tier": "default",
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": tools if isinstance(tools, list) else [],
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation", "disabled"),
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)},
            "output_tokens": ctoks,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + ctoks,
        },
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


# --- /v1/embeddings -------------------------------------------------------------------


def embedding_inputs(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The inputs of an embeddings request; raise :class:`BadRequest` as the API would."""
    value = body.get("input")
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value:
        if all(type(v) is int for v in value):
            return [value]
        if all(isinstance(v, str) and v for v in value):
            return list(value)
        if all(isinstance(v, list) and v and all(type(t) is int for t in v) for v in value):
            return list(value)
    raise BadRequest("'$.input' is invalid. Please check the API reference.", param="input")


def parse_embeddings(body: Any) -> ChatRequest:
    """Validate an embeddings request; raise :class:`BadRequest` as the API would."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    model = _model(body)
    embedding_inputs(body)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise BadRequest("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    dims = body.get("dimensions")
    most = DIMENSIONS.get(model, DEFAULT_DIMENSIONS)
    if dims is not None and (type(dims) is not int or not 1 <= dims <= most):
        raise BadRequest(f"'dimensions' must be an integer from 1 to {most}", param="dimensions")
    return ChatRequest(model, [], 0, False, False, body)


def embeddings_prompt_tokens(body: Mapping[str, Any], encoding: str) -> int:
    """The inputs' tokens: their text (no framing), a token-id input by its length."""
    return sum(
        len(entry) if isinstance(entry, list) else count_text(entry, encoding)
        for entry in embedding_inputs(body)
    )


def vector(model: str, entry: str | Sequence[int], dimensions: int) -> list[float]:
    """The unit vector of one input (the same for the same model and input, always)."""
    seed = hashlib.sha256(f"{model}\x00{json.dumps(entry)}".encode()).hexdigest()
    rng = random.Random(seed)
    values = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [round(v / norm, 8) for v in values]


def _encoded(values: list[float], fmt: str) -> list[float] | str:
    if fmt != "base64":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def embedding_list(req: ChatRequest, prompt_tokens: int) -> dict[str, Any]:
    """The embeddings answer: one vector per input, in input order."""
    body, model = req.body, req.model
    dims = body.get("dimensions") or DIMENSIONS.get(model, DEFAULT_DIMENSIONS)
    fmt = str(body.get("encoding_format") or "float")
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vector(model, entry, dims), fmt)}
        for i, entry in enumerate(embedding_inputs(body))
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
