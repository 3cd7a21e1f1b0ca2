"""The completion window as OpenAI writes it (a batch's output and error files are
rendered by PostgreSQL: tests/integration/test_files.py)."""

from __future__ import annotations

import pytest

from batchgen.domain.lifecycle.deadlines import format_duration, parse_duration_s


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(86400, "24h"), (3600, "1h"), (1800, "30m"), (90, "90s"), (3601, "3601s"), (0.5, "500ms")],
)
def test_a_completion_window_is_written_in_its_largest_whole_unit(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration_s(text) == seconds
