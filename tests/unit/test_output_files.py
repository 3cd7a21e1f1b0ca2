"""A batch's output and error files, rendered from its result rows (pure), and the
completion window as OpenAI writes it."""

from __future__ import annotations

import json

import pytest

from batchgen.domain.deadlines import format_duration, parse_duration_s
from batchgen.store.batches import ERRORS, OUTPUT
from batchgen.store.files import render_output

ROWS = [
    {
        "id": "batch_req_1",
        "custom_id": "a",
        "response": {"status_code": 200, "request_id": "r1", "body": {"id": "c1"}},
        "error": None,
    },
    {
        "id": "batch_req_2",
        "custom_id": "b",
        "response": None,
        "error": {"code": "expired", "message": "late"},
    },
    {
        "id": "batch_req_3",
        "custom_id": "c",
        "response": None,
        "error": {"code": "cancelled", "message": None},
    },
    {
        "id": "batch_req_4",
        "custom_id": "d",
        "response": None,
        "error": {"code": "bad_request", "message": "no"},
    },
]


def _read(kind: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in render_output(ROWS, kind)]


def test_the_output_file_holds_the_succeeded_rows_as_they_are():
    assert _read(OUTPUT) == [ROWS[0]]


def test_the_error_file_holds_the_rest_with_openai_codes_for_unrun_requests():
    rows = _read(ERRORS)
    assert [(r["custom_id"], r["error"]["code"]) for r in rows] == [  # type: ignore[index]
        ("b", "batch_expired"),
        ("c", "batch_cancelled"),
        ("d", "bad_request"),
    ]
    assert all(r["response"] is None for r in rows)


def test_every_line_ends_with_a_newline():
    assert all(line.endswith(b"\n") for line in render_output(ROWS, ERRORS))


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(86400, "24h"), (3600, "1h"), (1800, "30m"), (90, "90s"), (3601, "3601s"), (0.5, "500ms")],
)
def test_a_completion_window_is_written_in_its_largest_whole_unit(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration_s(text) == seconds
