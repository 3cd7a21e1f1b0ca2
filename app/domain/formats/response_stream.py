"""A Responses API ``Response`` as the server-sent events of a stream (pure).

A synchronous ``POST /v1/responses`` with ``stream: true`` is answered, once its
Response of record is complete, with the events the API streams:
``response.created`` and ``response.in_progress`` (the Response in progress, no
output yet), then per output item ``response.output_item.added``, its content
(``response.content_part.added``, ``response.output_text.delta`` pieces,
``response.output_text.done``, ``response.content_part.done``; a function call's
``response.function_call_arguments.delta`` / ``.done``), ``response.output_item.done``,
and last ``response.completed`` (``response.incomplete`` / ``response.failed`` by its
status) carrying the whole Response. The SDK's accumulator
(``client.responses.stream(...).get_final_response()``) rebuilds that Response.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

# Words per text delta (a few, as a provider's chunks carry).
WORDS_PER_DELTA = 3
_PIECE = re.compile(r"\S+\s*|\s+")
_END_EVENTS = {"incomplete": "response.incomplete", "failed": "response.failed"}


def text_pieces(text: str, words: int = WORDS_PER_DELTA) -> list[str]:
    """``text`` in pieces of a few words; ``"".join(result) == text``."""
    found = _PIECE.findall(text)
    return ["".join(found[i : i + words]) for i in range(0, len(found), words)] or [""]


def _in_progress(response: dict[str, Any]) -> dict[str, Any]:
    head = {k: v for k, v in response.items() if k not in ("output", "usage")}
    return {**head, "status": "in_progress", "output": [], "usage": None}


def _started(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as ``response.output_item.added`` carries it: before its content."""
    start = copy.deepcopy(item)
    if item.get("type") == "message":
        start["content"] = []
    elif item.get("type") == "function_call":
        start["arguments"] = ""
    if "status" in item:
        start["status"] = "in_progress"
    return start


def _message_events(item: dict[str, Any], index: int) -> Iterator[tuple[str, dict[str, Any]]]:
    ids = {"item_id": item.get("id"), "output_index": index}
    for j, part in enumerate(item.get("content") or ()):
        where = {**ids, "content_index": j}
        if not isinstance(part, dict) or part.get("type") != "output_text":
            yield "response.content_part.added", {**where, "part": part}
            yield "response.content_part.done", {**where, "part": part}
            continue
        text = part.get("text") or ""
        yield "response.content_part.added", {**where, "part": {**part, "text": ""}}
        for piece in text_pieces(text):
            yield "response.output_text.delta", {**where, "delta": piece, "logprobs": []}
        logprobs = part.get("logprobs") or []
        yield "response.output_text.done", {**where, "text": text, "logprobs": logprobs}
        yield "response.content_part.done", {**where, "part": part}


def _item_events(item: dict[str, Any], index: int) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "response.output_item.added", {"output_index": index, "item": _started(item)}
    if item.get("type") == "message":
        yield from _message_events(item, index)
    elif item.get("type") == "function_call":
        ids = {"item_id": item.get("id"), "output_index": index}
        arguments = item.get("arguments") or ""
        yield "response.function_call_arguments.delta", {**ids, "delta": arguments}
        done = {**ids, "arguments": arguments, "name": item.get("name")}
        yield "response.function_call_arguments.done", done
    yield "response.output_item.done", {"output_index": index, "item": item}


def response_events(response: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(event type, data)`` of each event of ``response``'s stream, numbered by
    ``sequence_number`` from 0."""

    def events() -> Iterator[tuple[str, dict[str, Any]]]:
        start = _in_progress(response)
        yield "response.created", {"response": start}
        yield "response.in_progress", {"response": start}
        for index, item in enumerate(response.get("output") or ()):
            if isinstance(item, dict):
                yield from _item_events(item, index)
        end = _END_EVENTS.get(str(response.get("status")), "response.completed")
        yield end, {"response": response}

    for number, (kind, data) in enumerate(events()):
        yield kind, {"type": kind, "sequence_number": number, **data}


def sse(kind: str, data: dict[str, Any]) -> bytes:
    """One event as the Responses API writes it (``event:`` and ``data:`` lines)."""
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
