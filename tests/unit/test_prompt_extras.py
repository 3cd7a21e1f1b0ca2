"""Prompt tokens beside message text: images by the providers' documented formulas,
tool definitions, response_format schemas, and n choices in the reservation."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from batchgen.domain.formats import tokens
from batchgen.domain.formats.admission import validate_line
from batchgen.domain.formats.image_size import data_url_size, image_size
from batchgen.registry import get_registry
from batchgen.simulator import counting
from tests.images import png, png_data_url

ENC = "cl100k_base"


@pytest.mark.parametrize(
    ("size", "detail", "expected"),
    [
        ((1024, 1024), "high", 765),  # OpenAI's worked examples
        ((2048, 4096), "high", 1105),
        ((4096, 8192), "low", 85),
        ((512, 512), "auto", 255),
        (None, "high", 85 + 8 * 170),  # unknown size: the most it may cost
    ],
)
def test_openai_image_tokens(size, detail, expected):
    assert tokens.openai_image_tokens(size, detail) == expected


@pytest.mark.parametrize(
    ("size", "expected"),
    [((200, 200), 54), ((1000, 1000), 1334), ((1092, 1092), 1590), ((4000, 3000), 1600)],
)
def test_anthropic_image_tokens(size, expected):
    # Anthropic's table: 200 x 200 ~54, 1000 x 1000 ~1334, 1092 x 1092 ~1590; larger
    # images are scaled down to about 1 600 tokens.
    assert abs(tokens.anthropic_image_tokens(size) - expected) <= 10


def test_image_sizes_from_headers():
    assert image_size(png(640, 480)) == (640, 480)
    assert image_size(b"GIF89a" + struct.pack("<HH", 33, 44) + b"\0" * 8) == (33, 44)
    sof = b"\xff\xc0\x00\x11\x08" + struct.pack(">HH", 300, 400) + b"\0" * 12
    jpeg = b"\xff\xd8" + b"\xff\xe0\x00\x10" + b"JFIF\0" + b"\0" * 9 + sof
    assert image_size(jpeg) == (400, 300)
    webp = b"RIFF\0\0\0\0WEBPVP8X" + b"\0" * 8 + (99).to_bytes(3, "little") * 2
    assert image_size(webp) == (100, 100)
    assert data_url_size(png_data_url(7, 9)) == (7, 9)
    assert data_url_size("https://example.com/cat.png") is None
    assert data_url_size("data:image/png;base64,!!!") is None


QUESTION = "Where is my order 40213? It was due yesterday and the tracking page is empty."


def _msgs(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts]}]


def test_estimate_agrees_with_the_simulators_count():
    tool = {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its number.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "description": "The order number"},
                    "channel": {"type": "string", "enum": ["web", "shop", "phone"]},
                    "lines": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["order_id"],
            },
        },
    }
    b64 = base64.b64encode(png(900, 700)).decode()
    cases = [
        ("openai", {"tools": [tool]}, _msgs()),
        ("anthropic", {"tools": [tool], "tool_choice": "auto"}, _msgs()),
        ("openai", {}, _msgs({"type": "image_url", "image_url": {"url": png_data_url(900, 700)}})),
        (
            "anthropic",
            {},
            _msgs({"type": "image", "source": {"type": "base64", "data": b64}}),
        ),
    ]
    for api, body, messages in cases:
        estimate = tokens.count_messages(messages, ENC) + tokens.count_extras(
            body, messages, ENC, api == "anthropic"
        )
        billed = counting.prompt_tokens(api, body, messages, ENC)
        assert billed > tokens.count_messages(messages, ENC)
        assert abs(estimate - billed) <= 0.05 * billed, (api, body.keys(), estimate, billed)


def test_nothing_beside_text_counts_nothing():
    assert tokens.count_extras({"tools": []}, [{"role": "user", "content": "hi"}], ENC) == 0
    assert tokens.count_response_format({"type": "json_object"}, ENC) == 0


def test_admission_counts_tools_and_reserves_n_choices():
    body = {
        "model": "sim-small",
        "max_tokens": 50,
        "n": 3,
        "messages": [{"role": "user", "content": "hi"}],
    }
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    plain = validate_line(json.dumps(line).encode(), 1, get_registry())
    assert plain.max_tokens == 150  # n x max_tokens
    body["tools"] = [{"type": "function", "function": {"name": "f", "description": "Do it."}}]
    with_tool = validate_line(json.dumps(line).encode(), 1, get_registry())
    assert with_tool.prompt_tokens_est > plain.prompt_tokens_est
