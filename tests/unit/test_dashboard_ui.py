"""The dashboard's pure parts: money, progress segments, time left, and the charts'
SVG geometry."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest

from batchgen.monitoring.dashboard_display import (
    Box,
    bar_chart,
    bar_segments,
    format_duration_s,
    format_usd,
    line_chart,
    nice_max,
    open_items,
    progress,
    rate_per_min,
    time_left_s,
)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (Decimal("0"), "$0.00"),
        (Decimal("12.3456789012"), "$12.35"),
        ("1234567.005", "$1,234,567.01"),
        (Decimal("0.01"), "$0.01"),
        (Decimal("0.0099999"), "$0.0100"),
        (Decimal("0.0041999999"), "$0.0042"),
        (Decimal("0.00005"), "$0.0001"),
        (Decimal("0.0000421"), "<$0.0001"),
        ("-2.5", "-$2.50"),
        (0.125, "$0.13"),
        ("0E-10", "$0.00"),
    ],
)
def test_format_usd_is_money(value, shown):
    assert format_usd(value) == shown


def test_a_cancelled_bar_is_not_a_completed_one():
    completed = bar_segments({"succeeded": 40, "total": 40})
    cancelled = bar_segments({"succeeded": 12, "cancelled": 28, "total": 40})
    assert [(s.status, s.pct) for s in completed] == [("succeeded", 100.0)]
    assert [(s.status, s.items, s.pct) for s in cancelled] == [
        ("succeeded", 12, 30.0),
        ("cancelled", 28, 70.0),
    ]
    running = bar_segments({"pending": 5, "running": 2, "failed": 1, "succeeded": 2})
    assert [s.status for s in running] == ["succeeded", "failed", "running", "pending"]
    assert bar_segments({"total": 0}) == []


def test_rate_counts_only_the_time_the_batch_existed():
    assert rate_per_min(30, 300, 3600) == 6.0  # an old batch: over the whole window
    assert rate_per_min(30, 300, 15) == 120.0  # 15 s old: over its 15 s
    assert rate_per_min(2, 300, 0.2) == 120.0  # under a second: over one second
    assert rate_per_min(0, 300, 50) == 0.0


def test_time_left():
    assert open_items({"pending": 3, "queued": 2, "running": 1, "succeeded": 9}) == 6
    assert time_left_s(0, 0) == 0.0
    assert time_left_s(10, 0) is None  # nothing finished lately: no estimate
    assert time_left_s(30, 12.0) == 150.0
    assert format_duration_s(150.0) == "2 min 30 s"
    assert format_duration_s(7500.2) == "2 h 05 min"
    assert format_duration_s(0.4) == "1 s"
    assert format_duration_s(None) == "unknown"


def test_nice_max():
    assert [nice_max(v) for v in (0, 0.3, 1, 7, 12, 21, 2400, 90_001)] == [
        1.0,
        0.5,
        1.0,
        10.0,
        20.0,
        25.0,
        2500.0,
        100_000.0,
    ]


def _points(path: str) -> list[tuple[float, float]]:
    assert re.fullmatch(r"M[\d.]+,[\d.]+( L[\d.]+,[\d.]+)*", path), path
    return [(float(x), float(y)) for x, y in re.findall(r"([\d.]+),([\d.]+)", path)]


def test_line_chart_maps_values_into_the_box():
    box = Box(width=200, height=120, left=20, right=0, top=10, bottom=10)  # plot 180 x 100
    chart = line_chart({"a": [0, 5, 10], "b": [2, 2, 2]}, box=box, x_labels=["-2", "-1", "now"])
    a, b = chart.lines
    assert a.name == "a" and a.last == 10
    # y from 0 (bottom, 110) to the axis top 10 (top, 10); x from 20 to 200.
    assert _points(a.path) == [(20, 110), (110, 60), (200, 10)]
    assert _points(b.path) == [(20, 90), (110, 90), (200, 90)]
    assert [(t.y, t.label) for t in chart.ticks] == [(110, "0"), (60, "5"), (10, "10")]
    assert chart.x_labels == [(20, "-2"), (110, "-1"), (200, "now")]
    assert chart.limit_y is None


def test_a_limit_sets_the_axis_and_gets_its_line():
    box = Box(width=200, height=120, left=20, right=0, top=10, bottom=10)
    chart = line_chart({"tokens": [100, 400]}, box=box, limit=1000, limit_label="1,000/min")
    assert chart.ticks[-1].label == "1k"
    assert chart.limit_y == 10  # the limit is the axis' top
    assert _points(chart.lines[0].path) == [(20, 100), (200, 70)]
    over = line_chart({"tokens": [3000]}, box=box, limit=1000)
    assert over.ticks[-1].label == "5k" and over.limit_y == 90
    assert _points(over.lines[0].path) == [(110, 50)]  # one point: in the middle


def test_an_empty_chart_has_no_lines():
    chart = line_chart({})
    assert chart.lines == [] and chart.ticks[-1].label == "1"


def test_bar_chart():
    box = Box(width=220, height=120, left=20, right=0, top=10, bottom=10)  # plot 200 x 100
    bars = bar_chart([("acme", 4.0), ("globex", 1.0)], box=box, label_of=format_usd)
    assert [(b.label, b.x, b.width, b.y, b.height, b.value_label) for b in bars] == [
        ("acme", 42.0, 56.0, 30.0, 80.0, "$4.00"),  # the axis' top: 5; bars 56 wide at most
        ("globex", 142.0, 56.0, 90.0, 20.0, "$1.00"),
    ]
    assert bar_chart([]) == []


def test_a_cancelled_batchs_progress_is_not_a_done_ones():
    """Done counts what ran to an end; what ended without running is named beside it."""
    cancelled = progress({"total": 2000, "cancelled": 2000})
    assert (cancelled.done, cancelled.total, cancelled.unrun) == (0, 2000, {"cancelled": 2000})
    mixed = progress({"total": 10, "succeeded": 5, "failed": 1, "expired": 1, "cancelled": 3})
    assert (mixed.done, mixed.unrun) == (6, {"cancelled": 3, "expired": 1})
    assert progress({"total": 4, "succeeded": 4}).unrun == {}
