"""Anthropic Message Batch requests into the item format and results back out (pure)."""

from __future__ import annotations

import pytest

from batchgen.domain.formats.admission import CHAT_COMPLETIONS
from batchgen.domain.formats.message_batches import (
    parse_requests,
    sniff_format,
    to_chat_line,
    to_individual_response,
    to_message,
)
from batchgen.errors import ValidationFailed


def test_a_request_becomes_a_chat_line_with_its_system_prompt_first():
    line = to_chat_line(
        0,
        {
            "custom_id": "a",
            "params": {
                "model": "m",
                "max_tokens": 10,
                "system": "be brief",
                "stop_sequences": ["END"],
                "temperature": 0.2,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "text", "text": "yes?"}]},
                ],
            },
        },
    )
    assert line == {
        "custom_id": "a",
        "method": "POST",
        "url": CHAT_COMPLETIONS,
        "body": {
            "model": "m",
            "max_tokens": 10,
            "temperature": 0.2,
            "stop": ["END"],
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "yes?"}]},
            ],
            "anthropic_params": {
                "max_tokens": 10,
                "system": "be brief",
                "stop_sequences": ["END"],
                "temperature": 0.2,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "text", "text": "yes?"}]},
                ],
            },
        },
    }


def test_tools_images_thinking_cache_control_and_a_list_system_travel_whole():
    """Everything a Messages request says reaches the Anthropic adapter as it was sent
    (the model aside: the registry maps it); the chat messages carry its text only."""
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    params = {
        "model": "m",
        "max_tokens": 10,
        "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "top_k": 5,
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "what?"}]}],
    }
    body = to_chat_line(0, {"custom_id": "a", "params": params})["body"]
    assert body["anthropic_params"] == {k: v for k, v in params.items() if k != "model"}
    assert body["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "what?"}]},
    ]
    assert body["tools"] == [
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    ]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
TEXT = {"type": "text", "text": "x"}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (
            {"messages": [{"role": "user", "content": [TEXT, IMAGE]}]},
            "params.messages[0].content[1]",
        ),
        ({"system": [IMAGE]}, "params.system[0]"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "params.thinking"),
        (
            {"tools": [{"name": "f", "input_schema": {}}, {"type": "web", "name": "w"}]},
            "params.tools[1]",
        ),
    ],
)
def test_what_a_chat_provider_would_not_be_sent_is_refused_by_name(extra, field):
    """For a model served by another provider kind (it is sent the chat translation),
    a request carrying what that drops is refused, naming the request and the field."""
    params = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    request = {"custom_id": "a", "params": {**params, **extra}}
    with pytest.raises(ValidationFailed) as raised:
        to_chat_line(3, request, anthropic=False)
    assert raised.value.field == field and raised.value.line == 4
    assert str(raised.value).startswith(f"requests[3].{field}: ")
    assert to_chat_line(3, request)["body"]["anthropic_params"]  # an Anthropic model: whole


def test_a_chat_provider_gets_text_and_function_tools():
    params = {
        "max_tokens": 5,
        "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    }
    body = to_chat_line(0, {"custom_id": "a", "params": params}, anthropic=False)["body"]
    assert body["tools"][0]["function"]["name"] == "lookup"


@pytest.mark.parametrize("tools", [{"name": "x"}, [{"input_schema": {}}], ["lookup"]])
def test_malformed_tools_are_refused_by_name(tools):
    params = {"max_tokens": 5, "tools": tools, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationFailed) as raised:
        to_chat_line(0, {"custom_id": "a", "params": params})
    assert (raised.value.field or "").startswith("params.tools")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"messages": []}, "params.messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "params.messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            "params.messages[0].content[0]",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "params.stream"),
        ({"messages": [{"role": "user", "content": "x"}], "system": 3}, "params.system"),
    ],
)
def test_what_the_item_format_cannot_carry_is_refused_by_name(params, field):
    with pytest.raises(ValidationFailed) as raised:
        to_chat_line(2, {"custom_id": "x", "params": params})
    assert (raised.value.field, raised.value.line) == (field, 3)
    assert raised.value.message.startswith(f"requests[2].{field}")


COMPLETION = {
    "id": "chatcmpl-1",
    "model": "sim-claude",
    "choices": [
        {"message": {"role": "assistant", "content": "A chair."}, "finish_reason": "length"}
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3},
}


def test_a_providers_message_is_returned_as_it_came():
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": 1}}],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "cache_read_input_tokens": 40, "output_tokens": 2},
    }
    assert to_message(message) == message


def test_a_completions_tool_calls_become_tool_use_blocks():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    completion = {
        **COMPLETION,
        "choices": [
            {
                "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "finish_reason": "tool_calls",
            }
        ],
    }
    message = to_message(completion)
    assert message["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}
    ]
    assert message["stop_reason"] == "tool_use"


def test_a_completion_becomes_a_message():
    assert to_message(COMPLETION) == {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "model": "sim-claude",
        "content": [{"type": "text", "text": "A chair."}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 3},
    }


@pytest.mark.parametrize(
    ("error", "result"),
    [
        ({"code": "expired", "message": "late"}, {"type": "expired"}),
        ({"code": "cancelled", "message": None}, {"type": "canceled"}),
        (
            {"code": "bad_request", "message": "no"},
            {
                "type": "errored",
                "error": {
                    "type": "error",
                    "error": {"type": "invalid_request_error", "message": "no"},
                },
            },
        ),
    ],
)
def test_each_result_kind(error, result):
    row = {"custom_id": "x", "response": None, "error": error}
    assert to_individual_response(row) == {"custom_id": "x", "result": result}


def test_a_succeeded_row_carries_its_message():
    row = {"custom_id": "x", "response": {"status_code": 200, "body": COMPLETION}, "error": None}
    assert to_individual_response(row)["result"] == {
        "type": "succeeded",
        "message": to_message(COMPLETION),
    }


@pytest.mark.parametrize(
    ("head", "kind"),
    [
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n',
            "openai",
        ),
        (b'{"custom_id": "a", "params": {"model": "m"}}\n{"custom_id": "b"', "anthropic"),
        (b'\n{\n  "requests": [\n    {"custom_id": "a"', "anthropic"),
        (b"not json at all", "openai"),  # refused later, by the OpenAI validator's line errors
    ],
)
def test_a_batch_file_is_recognised_by_its_first_bytes(head, kind):
    assert sniff_format(head) == kind


def test_an_anthropic_file_reads_as_json_lines_or_one_document():
    lines = b'{"custom_id": "a", "params": {}}\n\n{"custom_id": "b", "params": {}}\n'
    assert [r["custom_id"] for r in parse_requests(lines)] == ["a", "b"]
    whole = b'{"requests": [{"custom_id": "c", "params": {}}]}'
    assert parse_requests(whole) == [{"custom_id": "c", "params": {}}]
    with pytest.raises(ValidationFailed) as raised:
        parse_requests(b'{"custom_id": "a", "params": {}}\n{"custom_id": \n')
    assert raised.value.line == 2
