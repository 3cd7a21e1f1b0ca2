"""Admission's estimate of a prompt (tools, images, response_format) against what the
simulator, counting the providers' way (app/simulator/counting.py), reports as the
prompt tokens it was billed: within 5 %, through a real batch on a real worker."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from batchgen import python_api as client
from batchgen.domain.formats.tokens import count_messages
from batchgen.store import db
from batchgen.store.schema import Item, Result
from tests.helpers import chat_line, make_tenant, wait_batches
from tests.images import png_data_url

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_products",
        "description": "Search the shop's catalog by keywords and price.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "Keywords to look for"},
                "max_price": {"type": "number", "description": "Highest price in EUR"},
                "in_stock": {"type": "boolean", "description": "Only products in stock"},
            },
            "required": ["query"],
        },
    },
}
PRODUCT_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "product",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "bullets": {"type": "array", "items": {"type": "string"}},
                "price": {"type": "number"},
            },
            "required": ["title", "bullets", "price"],
            "additionalProperties": False,
        },
    },
}


def _image_line(custom_id: str, width: int, height: int, detail: str) -> dict[str, Any]:
    line = chat_line(custom_id, text="Describe the product in this picture.")
    image = {
        "type": "image_url",
        "image_url": {"url": png_data_url(width, height), "detail": detail},
    }
    text = {"type": "text", "text": "Describe the product in this picture."}
    line["body"]["messages"] = [{"role": "user", "content": [text, image]}]
    return line


def _tools_line(custom_id: str, tools: list[Any]) -> dict[str, Any]:
    line = chat_line(custom_id, text="What's the weather like in Paris, and any umbrellas?")
    line["body"]["tools"] = tools
    return line


# The least each line's extras add to its message text, by the providers' documents.
EXTRA_AT_LEAST = {
    "one-tool": 50,
    "two-tools": 100,
    "image-high": 85 + 4 * 170,  # 1024 x 768: 2 x 2 tiles
    "image-low": 85,
    "image-big-auto": 85 + 4 * 170,  # fitted to 2048 x 1536, then 1024 x 768
    "image-tall": 85 + 8 * 170,  # 600 x 1800: 2 x 4 tiles
    "schema": 40,
}


def _schema_line() -> dict[str, Any]:
    line = chat_line("schema", text="A product card for a teapot.")
    line["body"]["response_format"] = PRODUCT_FORMAT
    return line


def test_estimates_of_tools_images_and_schemas_match_the_providers_count(
    clean_db, simulator, workers
):
    lines = [
        _tools_line("one-tool", [WEATHER_TOOL]),
        _tools_line("two-tools", [WEATHER_TOOL, SEARCH_TOOL]),
        _image_line("image-high", 1024, 768, "high"),
        _image_line("image-low", 1024, 768, "low"),
        _image_line("image-big-auto", 4000, 3000, "auto"),
        _image_line("image-tall", 600, 1800, "high"),
        _schema_line(),
    ]
    text_tokens = {
        line["custom_id"]: count_messages(line["body"]["messages"], "cl100k_base") for line in lines
    }
    make_tenant("estimates")
    batch = client.submit_batch(lines, tenant="estimates")
    workers(concurrency=4)
    wait_batches([batch["id"]])
    with db.session_scope() as s:
        rows = s.execute(
            select(Item.custom_id, Item.prompt_tokens_est, Result.prompt_tokens).join(
                Result, Result.item_id == Item.id
            )
        ).all()
    assert {r[0] for r in rows} == set(EXTRA_AT_LEAST)
    for custom_id, estimate, billed in rows:
        # The simulator billed the extras, not just the text ...
        assert billed - text_tokens[custom_id] >= EXTRA_AT_LEAST[custom_id], (custom_id, billed)
        # ... and the estimate is within 5 % of what it billed.
        assert abs(estimate - billed) <= 0.05 * billed, (custom_id, estimate, billed)
