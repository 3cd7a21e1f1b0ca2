"""A streamed synchronous call as its caller reads it: the provider's chunks passed on as
they arrive, as server-sent events (pure).

The chunks come in the form of the call's answer of record
(:attr:`batchgen.providers.base.ProviderRequest.on_chunk`): OpenAI
``chat.completion.chunk`` objects, or the events of an Anthropic ``Message``.

- ``/v1/chat/completions`` gets each chunk as it came, every field kept (each choice,
  tool-call deltas, logprobs, refusals); the usage chunk only when the caller asked for
  it (``stream_options.include_usage``: batchgen always asks the provider for it, to
  ledger the call), then ``[DONE]``.
- ``/v1/messages`` of an Anthropic model gets each event as it came; one of an
  OpenAI-format model gets the events of the ``Message`` that
  :func:`batchgen.domain.formats.message_batches.to_message` makes of the chunks' answer
  (:class:`MessageEvents`).

A stream's last event (``[DONE]``, ``message_stop``) is sent once its answer is
recorded: the caller's stream ends when the result is there to read. A call whose
answer did not come through as chunks (a worker ran it) is replayed whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from batchgen.domain.formats.call_rules import anthropic_stream, openai_stream, sse
from batchgen.domain.formats.message_batches import STOP_REASONS, to_message

DONE = b"data: [DONE]\n\n"
Event = tuple[str, dict[str, Any]]


class StreamPart(Protocol):
    """A provider ``chunk`` as it came, or the ``whole`` answer of record."""

    @property
    def chunk(self) -> dict[str, Any] | None: ...

    @property
    def whole(self) -> dict[str, Any] | None: ...


def openai_chunk(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any] | None:
    """A provider chunk as the caller gets it: unchanged, but without usage when the
    caller did not ask for it (None: the usage chunk itself)."""
    if include_usage or "usage" not in chunk:
        return chunk
    if not chunk.get("choices"):
        return None
    return {k: v for k, v in chunk.items() if k != "usage"}


def openai_sse(parts: Iterable[StreamPart], include_usage: bool) -> Iterator[bytes]:
    """A chat completion's stream: each chunk as it arrives, then ``[DONE]``."""
    for part in parts:
        if part.whole is not None:
            yield from openai_stream(part.whole, include_usage)
            return
        if part.chunk is not None:
            chunk = openai_chunk(part.chunk, include_usage)
            if chunk is not None:
                yield sse(chunk)
    yield DONE


class NativeEvents:
    """An Anthropic model's events, as they came; ``message_stop`` held for the end."""

    def __init__(self) -> None:
        self.stop: dict[str, Any] = {"type": "message_stop"}

    def of(self, event: dict[str, Any]) -> list[Event]:
        kind = str(event.get("type"))
        if kind == "message_stop":
            self.stop = event
            return []
        return [(kind, event)]

    def end(self) -> list[Event]:
        return [("message_stop", self.stop)]


class MessageEvents:
    """An OpenAI-format model's chunks as the events of the ``Message`` of their answer
    (:func:`~batchgen.domain.formats.message_batches.to_message`): the first choice's text as a
    text block, each of its tool calls as a ``tool_use`` block whose arguments arrive as
    ``input_json_delta``; the stop reason and usage at the end."""

    def __init__(self) -> None:
        self.started = False
        self.blocks = 0
        self.open: str | None = None  # "text", or "tool:<index>"
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}

    def _start(self, chunk: dict[str, Any]) -> Event:
        self.started = True
        message: dict[str, Any] = {
            "id": chunk.get("id") or "",
            "type": "message",
            "role": "assistant",
            "model": chunk.get("model") or "",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return "message_start", {"type": "message_start", "message": message}

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        index = self.blocks - 1
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _open(self, block: dict[str, Any], key: str) -> list[Event]:
        events = self._close()
        self.open = key
        start = {"type": "content_block_start", "index": self.blocks, "content_block": block}
        self.blocks += 1
        return [*events, ("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> Event:
        data = {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}
        return "content_block_delta", data

    def of(self, chunk: dict[str, Any]) -> list[Event]:
        events = [] if self.started else [self._start(chunk)]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # the Message is the first choice's
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open != "text":
                    events += self._open({"type": "text", "text": ""}, "text")
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                key = f"tool:{call.get('index', 0)}"
                if self.open != key:
                    block = {
                        "type": "tool_use",
                        "id": call.get("id"),
                        "name": function.get("name"),
                        "input": {},
                    }
                    events += self._open(block, key)
                if function.get("arguments"):
                    partial = {"type": "input_json_delta", "partial_json": function["arguments"]}
                    events.append(self._delta(partial))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events

    def end(self) -> list[Event]:
        events: list[Event] = []
        if self.blocks == 0:  # an empty answer is one empty text block
            events += self._open({"type": "text", "text": ""}, "text")
        events += self._close()
        finish = self.finish
        delta = {
            "stop_reason": STOP_REASONS.get(finish, "end_turn") if finish else None,
            "stop_sequence": None,
        }
        usage = {
            "input_tokens": int(self.usage.get("prompt_tokens") or 0),
            "output_tokens": int(self.usage.get("completion_tokens") or 0),
        }
        events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events


def anthropic_sse(parts: Iterable[StreamPart]) -> Iterator[bytes]:
    """A Messages stream: each event as it arrives (or made of each chunk as it arrives),
    then the last ones."""
    events: NativeEvents | MessageEvents | None = None
    for part in parts:
        if part.whole is not None:
            yield from anthropic_stream(to_message(part.whole))
            return
        chunk = part.chunk
        if chunk is None:
            continue
        if events is None:
            events = MessageEvents() if "choices" in chunk else NativeEvents()
        for name, data in events.of(chunk):
            yield sse(data, name)
    for name, data in (events or NativeEvents()).end():
        yield sse(data, name)
