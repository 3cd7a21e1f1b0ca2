"""A streamed call relayed to its caller (domain.formats.call_streams, the Anthropic adapter's
chat chunks, and the relay between the call's two threads)."""

from __future__ import annotations

import json
import threading
from typing import Any, NamedTuple

import pytest

from batchgen.domain.formats.answers import (
    AnthropicMerge,
    anthropic_events,
    merge_openai_chunks,
    openai_chunks,
)
from batchgen.domain.formats.call_streams import (
    MessageEvents,
    NativeEvents,
    anthropic_sse,
    openai_chunk,
    openai_sse,
)
from batchgen.domain.formats.message_batches import to_message
from batchgen.providers.anthropic import ChatChunks, chat_completion
from batchgen.worker.relay import WOKEN, ChunkRelay, End, Wake

USAGE = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "lookup", "arguments": '{"q": "red chair", "n": 2}'},
}

MESSAGE: dict[str, Any] = {
    "id": "msg_7",
    "type": "message",
    "role": "assistant",
    "model": "claude-x",
    "content": [{"type": "text", "text": "Hello there, friend"}],
    "stop_reason": "max_tokens",
    "stop_sequence": None,
    "usage": {"input_tokens": 11, "output_tokens": 4},
}


def _completion(content: str | None, tool_calls: list[dict[str, Any]], finish: str) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    second = {"index": 1, "message": {"role": "assistant", "content": "other"}}
    return {
        "id": "chatcmpl-9",
        "object": "chat.completion",
        "created": 5,
        "model": "gpt",
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish},
            {**second, "logprobs": None, "finish_reason": "stop"},
        ],
        "usage": USAGE,
    }


class Part(NamedTuple):
    chunk: dict[str, Any] | None = None
    whole: dict[str, Any] | None = None


def _events(raw: bytes) -> list[tuple[str | None, Any]]:
    """The (event name, data) pairs of a server-sent event stream."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name = None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


def test_the_usage_the_caller_did_not_ask_for_is_left_out():
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hi"}}], "usage": None}
    usage_chunk = {"id": "c", "choices": [], "usage": USAGE}
    assert openai_chunk(chunk, include_usage=True) is chunk
    assert openai_chunk(usage_chunk, include_usage=True) is usage_chunk
    assert openai_chunk(chunk, include_usage=False) == {"id": "c", "choices": chunk["choices"]}
    assert openai_chunk(usage_chunk, include_usage=False) is None
    plain = {"id": "c", "choices": []}
    assert openai_chunk(plain, include_usage=False) is plain


def test_an_openai_stream_relays_each_chunk_as_it_came_then_done():
    completion = _completion("Hi there", [CALL], "tool_calls")
    chunks = list(openai_chunks(completion, include_usage=True))
    raw = b"".join(openai_sse((Part(chunk=c) for c in chunks), include_usage=True))
    events = _events(raw)
    assert [data for _, data in events] == [*chunks, "[DONE]"]
    assert merge_openai_chunks(chunks) == completion


def test_an_answer_that_came_whole_is_replayed():
    completion = _completion("Hi", [], "stop")
    raw = b"".join(openai_sse([Part(whole=completion)], include_usage=False))
    data = [d for _, d in _events(raw)]
    assert data[-1] == "[DONE]"
    assert merge_openai_chunks(data[:-1])["choices"][0]["message"]["content"] == "Hi"


@pytest.mark.parametrize(
    ("content", "tool_calls", "finish"),
    [
        ("Hi there", [], "stop"),
        (None, [CALL], "tool_calls"),
        ("Let me look.", [CALL, {**CALL, "id": "call_2"}], "tool_calls"),
        ("", [], "length"),
    ],
)
def test_openai_chunks_as_message_events_make_the_message_of_their_answer(
    content, tool_calls, finish
):
    """The events merge into what :func:`to_message` makes of the chunks' whole answer:
    the first choice's text and tool calls, its stop reason and the usage."""
    completion = _completion(content, tool_calls, finish)
    events = MessageEvents()
    made = [e for chunk in openai_chunks(completion, True) for e in events.of(chunk)]
    made += events.end()
    merge = AnthropicMerge()
    for name, data in made:
        assert name == data["type"]
        merge.add(data)
    assert merge.stopped and made[-1][0] == "message_stop"
    assert merge.result() == to_message(completion)


def test_an_anthropic_models_events_pass_unchanged_with_their_stop_held_to_the_end():
    sent = [data for _, data in anthropic_events(MESSAGE)]
    sent[-1] = {"type": "message_stop", "extra": "kept"}
    native = NativeEvents()
    relayed = [data for event in sent for _, data in native.of(event)]
    assert relayed == sent[:-1] and all(a is b for a, b in zip(relayed, sent, strict=False))
    assert native.end() == [("message_stop", sent[-1])]
    raw = b"".join(anthropic_sse(Part(chunk=e) for e in sent))
    assert [(name, data) for name, data in _events(raw)] == [(e["type"], e) for e in sent]


def test_a_messages_stream_of_an_openai_model_is_its_answers_message():
    completion = _completion("Hi", [CALL], "tool_calls")
    parts = [Part(chunk=c) for c in openai_chunks(completion, True)]
    merge = AnthropicMerge()
    for name, data in _events(b"".join(anthropic_sse(parts))):
        assert name == data["type"]
        merge.add(data)
    assert merge.result() == to_message(completion)
    whole = _events(b"".join(anthropic_sse([Part(whole=completion)])))
    assert [name for name, _ in whole][0] == "message_start"


def test_chat_chunks_of_an_anthropic_stream_make_its_chat_completion():
    """The Anthropic adapter, for a line in OpenAI form, relays chat chunks that merge
    into the answer it records (:func:`chat_completion`)."""
    cache = {"prompt_tokens_details": {"cached_tokens": 8}, "cache_read_input_tokens": 8}
    chat = ChatChunks("claude-x", created=42)
    chunks = [c for _, event in anthropic_events(MESSAGE) for c in chat.of(event, 11, cache)]
    want = chat_completion("msg_7", "claude-x", "Hello there, friend", "length", 11, 4, cache)
    want["created"] = 42
    merged = merge_openai_chunks(chunks)
    assert merged["choices"][0].pop("logprobs") is None  # the merge's, absent from the record
    assert merged == want


def test_the_relay_keeps_order_and_a_heard_end_wakes_its_reader():
    relay = ChunkRelay()
    assert relay.take(0.01) is None
    relay.chunk({"n": 1})
    relay.chunk({"n": 2})
    relay.ended("succeeded")
    assert [relay.take(1), relay.take(1), relay.take(1)] == [{"n": 1}, {"n": 2}, End("succeeded")]
    assert relay.produced == 2
    wake = Wake(relay)
    threading.Timer(0.05, wake.set).start()
    assert relay.take(10) is WOKEN and wake.is_set()
