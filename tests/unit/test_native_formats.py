"""OpenAI chat in and out of Gemini's and Bedrock's native formats (pure): what is
sent, what is refused (by field), and how answers, streams and usage come back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchgen.domain.formats import bedrock_converse, gemini_chat, refusal
from batchgen.domain.formats.chat import parse_chat
from tests.images import png_data_url

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "find",
            "description": "Find it.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be terse."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": png_data_url(4, 4)}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "find", "arguments": '{"q": "x"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"found": 1}'},
            {"role": "user", "content": "And then?"},
        ],
        **extra,
    }


def test_gemini_request_carries_every_part() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
    sent = gemini_chat.request(
        body(tools=TOOLS, tool_choice="required", response_format=fmt, max_tokens=9, seed=4),
        "gemini",
        100,
    )
    contents, config = sent["contents"], sent["config"]
    assert [c["role"] for c in contents] == ["user", "model", "user"]
    assert contents[0]["parts"][0] == {"text": "What is this?"}
    assert contents[0]["parts"][1]["inline_data"]["mime_type"] == "image/png"
    assert contents[0]["parts"][1]["inline_data"]["data"].startswith(b"\x89PNG")
    assert contents[1]["parts"] == [
        {"function_call": {"id": "c1", "name": "find", "args": {"q": "x"}}}
    ]
    result, follow = contents[2]["parts"]
    assert result["function_response"] == {"id": "c1", "name": "find", "response": {"found": 1}}
    assert follow == {"text": "And then?"}
    assert config["system_instruction"] == {"parts": [{"text": "Be terse."}]}
    assert config["max_output_tokens"] == 9 and config["seed"] == 4
    assert config["response_mime_type"] == "application/json"
    assert config["response_json_schema"] == {"type": "object"}
    declaration = config["tools"][0]["function_declarations"][0]
    assert (
        declaration["name"] == "find" and declaration["parameters_json_schema"]["type"] == "object"
    )
    assert config["tool_config"] == {"function_calling_config": {"mode": "ANY"}}


def test_bedrock_request_carries_every_part() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
    chosen = {"type": "function", "function": {"name": "find"}}
    sent = bedrock_converse.request(
        body(tools=TOOLS, tool_choice=chosen, response_format=fmt, stop="END"), 77
    )
    assert sent["system"] == [{"text": "Be terse."}]
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]
    image = sent["messages"][0]["content"][1]["image"]
    assert image["format"] == "png" and image["source"]["bytes"].startswith(b"\x89PNG")
    use = sent["messages"][1]["content"][0]["toolUse"]
    assert use == {"toolUseId": "c1", "name": "find", "input": {"q": "x"}}
    assert sent["messages"][2]["content"][0]["toolResult"]["toolUseId"] == "c1"
    assert sent["inferenceConfig"] == {"maxTokens": 77, "stopSequences": ["END"]}
    assert sent["toolConfig"]["toolChoice"] == {"tool": {"name": "find"}}
    schema = sent["outputConfig"]["textFormat"]["structure"]["jsonSchema"]
    assert json.loads(schema["schema"]) == {"type": "object"} and schema["name"] == "s"


@pytest.mark.parametrize(
    ("kind", "extra", "field"),
    [
        ("gemini", {"logprobs": True}, "body.logprobs"),
        ("gemini", {"logit_bias": {"1": 2}}, "body.logit_bias"),
        ("bedrock", {"n": 2}, "body.n"),
        ("bedrock", {"seed": 1}, "body.seed"),
        ("bedrock", {"response_format": {"type": "json_object"}}, "body.response_format.type"),
        ("bedrock", {"tools": TOOLS, "tool_choice": "none"}, "body.tool_choice"),
        ("gemini", {"tools": [{"type": "web_search"}]}, "body.tools[0].type"),
        ("vertex", {"reasoning_effort": "extreme"}, "body.reasoning_effort"),
    ],
)
def test_what_cannot_be_translated_is_refused_by_field(
    kind: str, extra: dict[str, Any], field: str
) -> None:
    why = refusal(body(**extra), kind)
    assert why is not None and why.field == field


def test_images_by_url_and_other_parts_are_refused_by_field() -> None:
    remote = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
    }
    why = refusal({"messages": [remote]}, "gemini")
    assert why is not None and why.field == "body.messages[0].content[0].image_url.url"
    gs = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "gs://b/y.png"}}]}
    assert refusal({"messages": [gs]}, "vertex") is None  # Vertex AI reads Cloud Storage
    assert refusal({"messages": [gs]}, "bedrock") is not None
    audio = {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
    why = refusal({"messages": [audio]}, "bedrock")
    assert why is not None and why.field == "body.messages[0].content[0].type"
    orphan = {"role": "tool", "tool_call_id": "nope", "content": "x"}
    why = refusal({"messages": [{"role": "user", "content": "hi"}, orphan]}, "gemini")
    assert why is not None and why.field == "body.messages[1].tool_call_id"
    assert refusal(body(user="u", metadata={"a": "b"}, service_tier="auto"), "bedrock") is None


def test_consecutive_turns_of_one_role_merge() -> None:
    chat = parse_chat(
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        "bedrock",
    )
    assert len(chat.turns) == 1 and chat.turns[0].parts == ["a", "b"]


def test_a_gemini_answer_as_a_chat_completion() -> None:
    answer = {
        "response_id": "r1",
        "model_version": "gemini-2.5-flash-001",
        "candidates": [
            {
                "index": 0,
                "content": {
                    "role": "model",
                    "parts": [
                        {"text": "hidden reasoning", "thought": True},
                        {"text": "Hello"},
                        {"function_call": {"name": "find", "args": {"q": 1}}},
                    ],
                },
                "finish_reason": "STOP",
            }
        ],
        "usage_metadata": {
            "prompt_token_count": 100,
            "candidates_token_count": 20,
            "thoughts_token_count": 30,
            "cached_content_token_count": 64,
            "total_token_count": 150,
        },
    }
    out = gemini_chat.chat_completion(answer, "gemini-2.5-flash", 5)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Hello"
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "find", "arguments": '{"q": 1}'}
    assert (
        call["id"].startswith("call_")
        and call["id"]
        == gemini_chat.chat_completion(answer, "x", 5)["choices"][0]["message"]["tool_calls"][0][
            "id"
        ]
    )
    assert out["usage"]["prompt_tokens"] == 100 and out["usage"]["completion_tokens"] == 50
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 30}
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    assert out["model"] == "gemini-2.5-flash-001" and out["id"] == "r1"
    rest = {"usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1}}
    camel = {
        **rest,
        "candidates": [{"content": {"parts": [{"text": "x"}]}, "finishReason": "MAX_TOKENS"}],
    }
    assert gemini_chat.chat_completion(camel, "m", 1)["choices"][0]["finish_reason"] == "length"
    blocked = gemini_chat.chat_completion({"usage_metadata": {"prompt_token_count": 3}}, "m", 1)
    assert blocked["choices"][0]["finish_reason"] == "content_filter"
    with pytest.raises(KeyError):
        gemini_chat.chat_completion({"candidates": []}, "m", 1)


def test_a_gemini_stream_merges_to_its_answer() -> None:
    merge = gemini_chat.StreamMerge("m", 7)
    parts = [{"text": "Hel"}, {"text": "lo"}]
    chunks = []
    for part in parts:
        chunks += merge.add({"response_id": "r", "candidates": [{"content": {"parts": [part]}}]})
    last = {
        "candidates": [{"content": {"parts": [{"text": ""}]}, "finish_reason": "STOP"}],
        "usage_metadata": {"prompt_token_count": 4, "candidates_token_count": 2},
    }
    chunks += merge.add(last)
    assert merge.finished
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texts = [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]]
    assert "".join(t for t in texts if t) == "Hello"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert merge.usage_chunk()["usage"]["total_tokens"] == 6
    result = merge.result()
    assert result["choices"][0]["message"]["content"] == "Hello" and result["id"] == "r"


def test_a_bedrock_answer_and_stream() -> None:
    answer = {
        "output": {
            "message": {
                "role": "assistant",
                "content": [
                    {"reasoningContent": {"reasoningText": {"text": "think"}}},
                    {"text": "Hi"},
                    {"toolUse": {"toolUseId": "t1", "name": "find", "input": {"q": 2}}},
                ],
            }
        },
        "stopReason": "tool_use",
        "usage": {
            "inputTokens": 10,
            "outputTokens": 5,
            "totalTokens": 15,
            "cacheReadInputTokens": 100,
            "cacheWriteInputTokens": 20,
        },
    }
    out = bedrock_converse.chat_completion(answer, "rid", "model", 3)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Hi"
    assert choice["message"]["tool_calls"][0]["id"] == "t1"
    usage = out["usage"]
    assert usage["prompt_tokens"] == 130 and usage["prompt_tokens_details"]["cached_tokens"] == 100
    assert usage["cache_creation_input_tokens"] == 20
    merge = bedrock_converse.StreamMerge("rid", "model", 3)
    events = [
        {"messageStart": {"role": "assistant"}},
        {"contentBlockDelta": {"contentBlockIndex": 0, "delta": {"text": "Hi"}}},
        {"contentBlockStop": {"contentBlockIndex": 0}},
        {
            "contentBlockStart": {
                "contentBlockIndex": 1,
                "start": {"toolUse": {"toolUseId": "t1", "name": "find"}},
            }
        },
        {"contentBlockDelta": {"contentBlockIndex": 1, "delta": {"toolUse": {"input": '{"q"'}}}},
        {"contentBlockDelta": {"contentBlockIndex": 1, "delta": {"toolUse": {"input": ": 2}"}}}},
        {"messageStop": {"stopReason": "tool_use"}},
        {"metadata": {"usage": answer["usage"]}},
    ]
    chunks = [c for e in events for c in merge.add(e)]
    assert merge.finished and len(chunks) >= 4
    assert merge.result()["choices"] == out["choices"]
    assert merge.usage_chunk()["usage"] == usage


def test_retry_delay_of_a_google_error() -> None:
    info = {"@type": gemini_chat.RETRY_INFO, "retryDelay": "7.5s"}
    assert gemini_chat.retry_delay_s({"error": {"code": 429, "details": [info]}}) == 7.5
    assert gemini_chat.retry_delay_s({"error": {"code": 429}}) is None
    assert gemini_chat.retry_delay_s({"code": 429, "details": [info]}) == 7.5
