"""Responses API and embeddings requests (pure): validation by line and field, their
token estimates, one endpoint per batch, the registry's endpoints, and a Response
replayed as the events of its stream."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from batchgen.config import DEFAULT_MODELS_FILE
from batchgen.domain.formats import tokens
from batchgen.domain.formats.admission import Limits, parse_lines
from batchgen.domain.formats.call_rules import as_line
from batchgen.domain.formats.response_stream import response_events
from batchgen.errors import ConfigError, ValidationFailed
from batchgen.registry import Endpoint, get_registry, parse_registry
from batchgen.simulator import sim_endpoints as sim
from tests.images import png_data_url

LIMITS = Limits(max_lines=100, max_bytes=1 << 20)
ENC = "cl100k_base"
TOOL = {
    "type": "function",
    "name": "find_product",
    "description": "Find a product in the catalog by its colour and kind.",
    "parameters": {
        "type": "object",
        "properties": {
            "colour": {"type": "string", "description": "The colour."},
            "kind": {"type": "string", "enum": ["chair", "table", "lamp"]},
        },
        "required": ["kind"],
    },
}


def line(url: str, custom_id: str = "a", **body: Any) -> bytes:
    row = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return json.dumps(row).encode() + b"\n"


def responses(custom_id: str = "a", **body: Any) -> bytes:
    return line("/v1/responses", custom_id, **{"model": "sim-small", **body})


def embeddings(custom_id: str = "a", **body: Any) -> bytes:
    return line("/v1/embeddings", custom_id, **{"model": "text-embedding-3-small", **body})


def parse(*lines: bytes, endpoint: str | None = None):
    return list(parse_lines(iter(lines), get_registry(), LIMITS, endpoint))


def refused(*lines: bytes, endpoint: str | None = None) -> ValidationFailed:
    with pytest.raises(ValidationFailed) as info:
        parse(*lines, endpoint=endpoint)
    return info.value


# --- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({}, "body.input", "is required"),
        ({"input": ""}, "body.input", "must not be empty"),
        ({"input": []}, "body.input", "non-empty list"),
        ({"input": [{"role": "user"}]}, "body.input[0].content", "content parts"),
        ({"input": [{"role": "robot", "content": "x"}]}, "body.input[0].role", "user"),
        ({"input": [3]}, "body.input[0]", "input item"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "body.input[0].content[0].text",
            "string",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_video", "url": "x"}]}]},
            "body.input[0].content[0].type",
            "input_text",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "body.input[0].content[0]",
            "image_url",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "body.input[0].call_id", "string"),
        ({"input": [{"content": "x"}]}, "body.input[0]", "'type'"),
        ({"input": "x", "instructions": 3}, "body.instructions", "string"),
        ({"input": "x", "tools": [{"type": "function"}]}, "body.tools[0].name", "string"),
        ({"input": "x", "tools": {}}, "body.tools", "list"),
        ({"input": "x", "max_output_tokens": 0}, "body.max_output_tokens", "greater than 0"),
        ({"input": "x", "max_output_tokens": 99999}, "body.max_output_tokens", "exceeds"),
        ({"input": "x", "stream": True}, "body.stream", "not available in batches"),
        ({"input": "x", "background": True}, "body.background", "background"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "body.text.format.type", "json"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}},
            "body.text.format.schema",
            "schema",
        ),
        # Objects stored at the provider under the keys every tenant shares.
        ({"input": "x", "previous_response_id": "resp_1"}, "body.previous_response_id", "share"),
        ({"input": "x", "conversation": "conv_1"}, "body.conversation", "share"),
        (
            {"input": [{"type": "item_reference", "id": "msg_1"}]},
            "body.input[0].type",
            "share",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "body.input[0].content[0].file_id",
            "share",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "body.input[0].content[0].file_id",
            "share",
        ),
        ({"input": "x", "model": "text-embedding-3-small"}, "body.model", "does not serve"),
        ({"input": "x", "model": "sim-claude"}, "body.model", "/v1/chat/completions"),
    ],
)
def test_a_bad_responses_line_names_its_line_and_field(body, field, words):
    error = refused(responses("ok", input="fine"), responses("bad", **body))
    assert (error.line, error.field) == (2, field)
    assert error.message.startswith(f"line 2, field {field!r}: ")
    assert words in error.message


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({}, "body.input", "is required"),
        ({"input": ""}, "body.input", "empty string"),
        ({"input": []}, "body.input", "non-empty list"),
        ({"input": ["a", ""]}, "body.input[1]", "non-empty string"),
        ({"input": ["a", 3]}, "body.input[1]", "non-empty string"),
        ({"input": [1, -2]}, "body.input[1]", "token id"),
        ({"input": [[1], []]}, "body.input[1]", "non-empty list of token ids"),
        ({"input": [{"text": "a"}]}, "body.input[0]", "string, a token id"),
        ({"input": ["a"] * 2049}, "body.input", "at most 2048"),
        ({"input": "x", "encoding_format": "int8"}, "body.encoding_format", "float"),
        ({"input": "x", "dimensions": 1537}, "body.dimensions", "1 to 1536"),
        ({"input": "x", "dimensions": 0}, "body.dimensions", "1 to 1536"),
        ({"input": "x", "user": 5}, "body.user", "string"),
        ({"input": "word " * 9000}, "body.input", "context window of 8192"),
        ({"input": ["a", "word " * 9000]}, "body.input[1]", "context window of 8192"),
        ({"input": [list(range(8193))]}, "body.input[0]", "more than 8192 tokens"),
        ({"input": [[1] * 8000] * 38}, "body.input", "at most 300000"),
        ({"input": "x", "model": "sim-small"}, "body.model", "does not serve /v1/embeddings"),
        ({"input": "x", "stream": True}, "body.stream", "not available in batches"),
    ],
)
def test_a_bad_embeddings_line_names_its_line_and_field(body, field, words):
    error = refused(embeddings("ok", input="fine"), embeddings("bad", **body))
    assert (error.line, error.field) == (2, field)
    assert words in error.message


def test_an_unknown_url_names_the_supported_endpoints():
    error = refused(line("/v1/completions", model="sim-small", prompt="x"))
    assert (error.line, error.field) == (1, "url")
    supported = "'/v1/chat/completions', '/v1/responses', '/v1/embeddings'"
    assert error.message.endswith(f"unsupported endpoint '/v1/completions'; supported: {supported}")


def test_a_batch_holds_one_endpoints_requests():
    chat = line(
        "/v1/chat/completions", "c", model="sim-small", messages=[{"role": "user", "content": "x"}]
    )
    error = refused(responses("r", input="x"), chat)
    assert (error.line, error.field) == (2, "url")
    assert "is not the batch's endpoint '/v1/responses'" in error.message
    error = refused(embeddings("e", input="x"), endpoint="/v1/chat/completions")
    assert (error.line, error.field) == (1, "url")
    drafts = parse(
        embeddings("e", input="x"), embeddings("f", input="y"), endpoint="/v1/embeddings"
    )
    assert [d.endpoint for d in drafts] == ["/v1/embeddings"] * 2


def test_a_call_body_is_one_line_of_its_endpoint():
    line_of, stream, _ = as_line(
        {"model": "sim-small", "input": "x", "stream": True, "timeout": 5}, "/v1/responses"
    )
    assert stream and line_of["url"] == "/v1/responses"
    assert line_of["body"] == {"model": "sim-small", "input": "x"}
    with pytest.raises(ValidationFailed) as info:
        as_line({"model": "text-embedding-3-small", "input": "x", "stream": True}, "/v1/embeddings")
    assert info.value.field == "stream"


# --- estimates -------------------------------------------------------------------------


def test_an_embedding_reserves_its_input_tokens_only():
    texts = ["A red oak chair with a woven seat.", "Ein Tisch aus Eiche.", "椅子"]
    (many, one, ids) = parse(
        embeddings("many", input=texts),
        embeddings("one", input=texts[0]),
        embeddings("ids", input=[[1, 2, 3], [4]]),
    )
    assert many.prompt_tokens_est == sum(tokens.count_text(t, ENC) for t in texts)
    assert one.prompt_tokens_est == tokens.count_text(texts[0], ENC)
    assert ids.prompt_tokens_est == 4
    assert many.max_tokens == one.max_tokens == ids.max_tokens == 0
    # The simulator counts the same input its own way, and reports the same.
    assert many.prompt_tokens_est == sim.embeddings_prompt_tokens({"input": texts}, ENC)


def test_a_response_counts_its_input_instructions_and_tools_and_reserves_its_output():
    cap = get_registry()["sim-small"].output_cap
    (bare,) = parse(responses(input="Describe a chair."))
    assert bare.max_tokens == cap
    as_chat = tokens.count_messages([{"role": "user", "content": "Describe a chair."}], ENC)
    assert bare.prompt_tokens_est == as_chat
    (told,) = parse(responses(input="Describe a chair.", instructions="Answer in French."))
    assert told.prompt_tokens_est > bare.prompt_tokens_est
    (tooled,) = parse(responses(input="Describe a chair.", tools=[TOOL], max_output_tokens=50))
    assert tooled.max_tokens == 50
    assert tooled.prompt_tokens_est == bare.prompt_tokens_est + tokens.count_tools([TOOL], ENC)
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Describe a chair."}]},
        {"type": "function_call", "call_id": "c1", "name": "find_product", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "A red chair."},
    ]
    (history,) = parse(responses(input=items))
    assert history.prompt_tokens_est > bare.prompt_tokens_est + tokens.count_text(
        "A red chair.", ENC
    )


@pytest.mark.parametrize(
    "body",
    [
        {"input": "Find a red chair for the dining room.", "tools": [TOOL]},
        {
            "instructions": "You write short product copy.",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is in this picture?"},
                        {
                            "type": "input_image",
                            "image_url": png_data_url(1024, 768),
                            "detail": "high",
                        },
                    ],
                }
            ],
        },
        {
            "input": "Describe a lamp as JSON.",
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "product",
                    "schema": {"type": "object", "properties": {"name": {"type": "string"}}},
                }
            },
        },
    ],
)
def test_a_response_estimate_is_within_5_percent_of_the_simulators_count(body):
    (draft,) = parse(responses(**body))
    request = sim.parse_responses({"model": "sim-small", **body}, 100)
    counted = sim.responses_prompt_tokens(request.body, request.prompt_messages, ENC)
    assert abs(draft.prompt_tokens_est - counted) <= 0.05 * counted, (
        draft.prompt_tokens_est,
        counted,
    )


# --- the registry ----------------------------------------------------------------------

MODEL = """
[models."m"]
provider = "{provider}"
base_url = "http://x/v1"
api_key_env = "K"
group = "g"
budget_key = "b"
context_window = 8192
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 1
input_usd_per_1m = 0.1
output_usd_per_1m = 0
{extra}
"""


def test_the_registry_says_which_endpoints_a_model_serves():
    registry = get_registry()
    assert registry["sim-small"].served == (Endpoint.CHAT_COMPLETIONS, Endpoint.RESPONSES)
    assert registry["sim-claude"].served == (Endpoint.CHAT_COMPLETIONS,)
    small = registry["text-embedding-3-small"]
    assert small.served == (Endpoint.EMBEDDINGS,) and small.dimensions == 1536
    assert small.max_output_tokens is None and small.output_cap == 0
    assert "text-embedding-3-large" in parse_registry(DEFAULT_MODELS_FILE.read_text()).names


@pytest.mark.parametrize(
    ("provider", "extra", "words"),
    [
        ("anthropic", 'endpoints = ["/v1/embeddings"]\ndimensions = 8', "anthropic model serves"),
        ("openai", 'endpoints = ["/v1/embeddings"]', "dimensions"),
        ("openai", "", "max_output_tokens"),
        ("openai", "endpoints = []\nmax_output_tokens = 5", "at least one"),
        ("openai", 'endpoints = ["/v1/completions"]\nmax_output_tokens = 5', "endpoints"),
    ],
)
def test_a_registry_entry_that_cannot_serve_its_endpoints_is_refused(provider, extra, words):
    with pytest.raises(ConfigError) as info:
        parse_registry(MODEL.format(provider=provider, extra=extra))
    assert "model 'm'" in str(info.value) and words in str(info.value)


# --- a Response as its stream ------------------------------------------------------------

RESPONSE: dict[str, Any] = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1,
    "status": "completed",
    "model": "sim-small",
    "output": [
        {"id": "rs_1", "type": "reasoning", "summary": []},
        {
            "id": "msg_1",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [
                {
                    "type": "output_text",
                    "text": "A sturdy chair of red oak, with a woven seat.",
                    "annotations": [],
                    "logprobs": [],
                }
            ],
        },
        {
            "id": "fc_1",
            "type": "function_call",
            "status": "completed",
            "arguments": '{"kind": "chair"}',
            "call_id": "call_1",
            "name": "find_product",
        },
    ],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "metadata": {},
    "usage": {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 20,
        "output_tokens_details": {"reasoning_tokens": 6},
        "total_tokens": 32,
    },
}


def test_a_response_replayed_as_events_rebuilds_itself_in_the_sdk():
    events = list(response_events(RESPONSE))
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert [kind for kind, _ in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0][1]["response"]["output"] == [] and events[0][1]["response"]["usage"] is None
    deltas = [d["delta"] for k, d in events if k == "response.output_text.delta"]
    assert len(deltas) > 2 and "".join(deltas) == RESPONSE["output"][1]["content"][0]["text"]
    assert events[-1] == (
        "response.completed",
        {"type": "response.completed", "sequence_number": len(events) - 1, "response": RESPONSE},
    )

    state = ResponseStreamState(input_tools=omit, text_format=omit)
    emitted = []
    for _, data in events:
        emitted += state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))
    final = emitted[-1].response
    assert final.output_text == RESPONSE["output"][1]["content"][0]["text"]
    assert final.output[2].arguments == RESPONSE["output"][2]["arguments"]
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 6


def test_an_incomplete_response_ends_its_stream_as_incomplete():
    cut = {
        **RESPONSE,
        "status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"},
    }
    assert list(response_events(cut))[-1][0] == "response.incomplete"


def test_the_simulators_vectors_are_unit_length_and_as_asked():
    request = sim.parse_embeddings({"model": "text-embedding-3-large", "input": ["a", "b"]})
    listed = sim.embedding_list(request, 2)
    first = listed["data"][0]["embedding"]
    assert len(first) == 3072 and abs(sum(v * v for v in first) - 1.0) < 1e-6
    assert first != listed["data"][1]["embedding"]
    again = sim.embedding_list(request, 2)
    assert again == listed
    short = sim.parse_embeddings(
        {
            "model": "text-embedding-3-large",
            "input": "a",
            "dimensions": 4,
            "encoding_format": "base64",
        }
    )
    packed = sim.embedding_list(short, 1)["data"][0]["embedding"]
    assert len(base64.b64decode(packed)) == 4 * 4
