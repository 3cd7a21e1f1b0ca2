"""Streams merged into whole answers and answers replayed as streams (domain.formats.answers)."""

from __future__ import annotations

import copy
import json
from typing import Any

from batchgen.domain.formats.answers import (
    AnthropicMerge,
    anthropic_events,
    merge_openai_chunks,
    openai_chunks,
)
from batchgen.domain.formats.call_rules import anthropic_stream, openai_stream

HEAD = {"id": "chatcmpl-1", "created": 7, "model": "gpt", "system_fingerprint": "fp_1"}
LOGPROB = {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}
USAGE = {
    "prompt_tokens": 30,
    "completion_tokens": 9,
    "total_tokens": 39,
    "prompt_tokens_details": {"cached_tokens": 20},
    "completion_tokens_details": {"reasoning_tokens": 4},
}
COMPLETION: dict[str, Any] = {
    **HEAD,
    "object": "chat.completion",
    "service_tier": "default",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi there", "refusal": None},
            "logprobs": {"content": [LOGPROB, {**LOGPROB, "token": " there"}], "refusal": None},
            "finish_reason": "stop",
        },
        {
            "index": 1,
            "message": {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"q": "chair"}'},
                    }
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        },
    ],
    "usage": USAGE,
}


def _chunk(index: int, delta: dict[str, Any], **more: Any) -> dict[str, Any]:
    part = {"index": index, "delta": delta, "finish_reason": None, **more}
    return {**HEAD, "object": "chat.completion.chunk", "choices": [part]}


def test_chunks_as_a_provider_sends_them_merge_into_every_choice_call_and_logprob():
    chunks = [
        {
            **_chunk(0, {"role": "assistant", "content": "", "refusal": None}, logprobs=None),
            "obfuscation": "pad",
        },
        _chunk(1, {"role": "assistant", "content": None, "refusal": None}, logprobs=None),
        _chunk(0, {"content": "Hi"}, logprobs={"content": [LOGPROB], "refusal": None}),
        _chunk(
            1,
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": ""},
                    }
                ]
            },
        ),
        _chunk(0, {"content": " there"}, logprobs={"content": [{**LOGPROB, "token": " there"}]}),
        _chunk(1, {"tool_calls": [{"index": 0, "function": {"arguments": '{"q": '}}]}),
        _chunk(1, {"tool_calls": [{"index": 0, "function": {"arguments": '"chair"}'}}]}),
        _chunk(0, {}, finish_reason="stop"),
        _chunk(1, {}, finish_reason="tool_calls"),
        {**HEAD, "object": "chat.completion.chunk", "service_tier": "default", "choices": []},
        {**HEAD, "object": "chat.completion.chunk", "choices": [], "usage": USAGE},
    ]
    merged = merge_openai_chunks(chunks)
    assert merged == {**COMPLETION, "choices": merged["choices"]}
    assert [c["message"] for c in merged["choices"]] == [
        c["message"] for c in COMPLETION["choices"]
    ]
    assert (
        merged["choices"][0]["logprobs"]["content"]
        == COMPLETION["choices"][0]["logprobs"]["content"]
    )
    assert merged["choices"][1]["finish_reason"] == "tool_calls"


def test_an_answer_replayed_as_a_stream_merges_back_into_itself():
    original = copy.deepcopy(COMPLETION)
    chunks = list(openai_chunks(COMPLETION, include_usage=True))
    assert original == COMPLETION  # not changed in place
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert merge_openai_chunks(chunks) == COMPLETION
    without_usage = list(openai_chunks(COMPLETION, include_usage=False))
    assert all("usage" not in c for c in without_usage)


def test_the_event_stream_bytes_carry_the_same_chunks():
    events = b"".join(openai_stream(COMPLETION, include_usage=True)).decode().split("\n\n")
    datas = [e.removeprefix("data: ") for e in events if e]
    assert datas[-1] == "[DONE]"
    assert merge_openai_chunks(json.loads(d) for d in datas[:-1]) == COMPLETION


MESSAGE: dict[str, Any] = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude",
    "content": [
        {"type": "thinking", "thinking": "Let me see.", "signature": "sig"},
        {"type": "text", "text": "A chair.", "citations": None},
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "chair"}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 40,
        "output_tokens": 12,
    },
}


def test_a_message_replayed_as_events_merges_back_into_itself():
    merge = AnthropicMerge()
    for _, data in anthropic_events(MESSAGE):
        merge.add(data)
    assert merge.stopped and merge.result() == MESSAGE
    assert merge.text() == "A chair."


def test_the_anthropic_event_stream_bytes_name_each_event():
    merge = AnthropicMerge()
    for event in b"".join(anthropic_stream(MESSAGE)).decode().split("\n\n"):
        if event:
            name, data = event.split("\n")
            payload = json.loads(data.removeprefix("data: "))
            assert name == f"event: {payload['type']}"
            merge.add(payload)
    assert merge.result() == MESSAGE
