"""Dollar budgets' maths (pure): worst-case prices at each tier, periods in time zones
(day and month, DST, month and year roll), thresholds crossed."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest

from batchgen.domain.billing import budget_maths
from batchgen.domain.billing.budget_maths import Period
from batchgen.errors import ValidationFailed
from batchgen.registry import ModelSpec, Tier

UTC = dt.UTC


def _spec(**kw: object) -> ModelSpec:
    fields: dict[str, object] = {
        "name": "m",
        "provider": "openai",
        "base_url": "http://x",
        "api_key_env": "K",
        "group": "g",
        "budget_key": "b",
        "context_window": 10_000,
        "max_output_tokens": 1000,
        "tokens_per_min": 100_000,
        "requests_per_min": 10,
        "max_concurrency": 1,
        "input_usd_per_1m": 1.0,
        "output_usd_per_1m": 4.0,
    }
    fields.update(kw)
    return ModelSpec.model_validate(fields)


def test_worst_case_is_estimate_at_input_plus_max_output_at_output_price():
    spec = _spec()
    # 1000 prompt tokens at $1/1M + 500 output at $4/1M = $0.001 + $0.002
    assert budget_maths.worst_case_usd(spec, 1000, 500) == Decimal("0.003")
    assert budget_maths.worst_case_micros(spec, 1000, 500) == 3000


def test_worst_case_at_each_tier():
    spec = _spec()
    assert budget_maths.worst_case_micros(spec, 1000, 500, Tier.STANDARD) == 3000
    assert budget_maths.worst_case_micros(spec, 1000, 500, Tier.BATCH) == 1500  # half price
    assert budget_maths.worst_case_micros(spec, 1000, 500, Tier.FLEX) == 1500
    flex = {"input_usd_per_1m": 0.2, "output_usd_per_1m": 1.0, "reasoning_usd_per_1m": 1.0}
    priced = _spec(tiers={"flex": flex})
    assert budget_maths.worst_case_micros(priced, 1000, 500, Tier.FLEX) == 700


def test_a_prompt_margin_scales_the_estimate_only():
    spec = _spec(provider="anthropic", input_usd_per_1m=3.0, output_usd_per_1m=15.0)
    assert budget_maths.worst_case_micros(spec, 1000, 100) == 3000 + 1500
    # a cache write is 1.25x input: a margin covers a prompt billed as one
    assert budget_maths.worst_case_micros(spec, 1000, 100, prompt_margin=1.25) == 3750 + 1500


def test_micros_round_up_never_down():
    assert budget_maths.to_micros(Decimal("0.0000001")) == 1
    assert budget_maths.to_micros("0.5") == 500_000
    assert budget_maths.to_usd(1_500_000) == Decimal("1.5")


def test_fits_is_used_plus_reserved_plus_amount_within_the_limit():
    assert budget_maths.fits(400, 500, 100, 1000)
    assert not budget_maths.fits(400, 500, 101, 1000)


def test_a_utc_day_and_its_reset():
    now = dt.datetime(2026, 12, 5, 23, 59, 30, tzinfo=UTC)
    win = budget_maths.window(Period.DAY, "UTC", now)
    assert win.key == "d20261205"
    assert win.start == dt.datetime(2026, 12, 5, tzinfo=UTC)
    assert win.end == dt.datetime(2026, 12, 6, tzinfo=UTC)
    assert budget_maths.retry_after_s(win, now) == 30


def test_a_day_in_a_named_time_zone():
    # 03:00 UTC on Dec 5 is still Dec 4 in New York (UTC-5)
    now = dt.datetime(2026, 12, 5, 3, 0, tzinfo=UTC)
    win = budget_maths.window(Period.DAY, "America/New_York", now)
    assert win.key == "d20261204"
    assert win.start == dt.datetime(2026, 12, 4, 5, 0, tzinfo=UTC)
    assert win.end == dt.datetime(2026, 12, 5, 5, 0, tzinfo=UTC)


def test_a_day_with_a_daylight_saving_change_is_23_hours():
    now = dt.datetime(2026, 3, 8, 12, 0, tzinfo=UTC)  # US spring forward
    win = budget_maths.window(Period.DAY, "America/New_York", now)
    assert win.start is not None and win.end is not None
    assert win.end - win.start == dt.timedelta(hours=23)


def test_month_roll_and_year_roll():
    win = budget_maths.window(Period.MONTH, "UTC", dt.datetime(2026, 1, 31, 12, tzinfo=UTC))
    assert (win.key, win.end) == ("m202601", dt.datetime(2026, 2, 1, tzinfo=UTC))
    win = budget_maths.window(Period.MONTH, "UTC", dt.datetime(2026, 12, 31, 23, tzinfo=UTC))
    assert (win.key, win.end) == ("m202612", dt.datetime(2027, 1, 1, tzinfo=UTC))
    feb = budget_maths.window(Period.MONTH, "UTC", dt.datetime(2028, 2, 29, tzinfo=UTC))
    assert feb.end == dt.datetime(2028, 3, 1, tzinfo=UTC)


def test_a_month_in_tokyo_starts_the_evening_before_in_utc():
    now = dt.datetime(2026, 11, 30, 16, 0, tzinfo=UTC)  # Dec 1, 01:00 in Tokyo
    win = budget_maths.window(Period.MONTH, "Asia/Tokyo", now)
    assert win.key == "m202612"
    assert win.start == dt.datetime(2026, 11, 30, 15, 0, tzinfo=UTC)


def test_a_total_budget_never_resets():
    win = budget_maths.window(Period.TOTAL, "UTC", dt.datetime(2026, 1, 1, tzinfo=UTC))
    assert (win.key, win.start, win.end) == ("total", None, None)
    assert budget_maths.retry_after_s(win, dt.datetime(2026, 1, 1, tzinfo=UTC)) is None


def test_thresholds_crossed_once_between_two_levels():
    assert budget_maths.crossed(0, 499_999, 1_000_000, (50, 80, 100)) == []
    assert budget_maths.crossed(0, 500_000, 1_000_000, (50, 80, 100)) == [50]
    assert budget_maths.crossed(500_000, 1_000_000, 1_000_000, (50, 80, 100)) == [80, 100]
    assert budget_maths.crossed(800_000, 900_000, 1_000_000, (50, 80, 100)) == []
    assert budget_maths.reached(850_000, 1_000_000, (50, 80, 100)) == [50, 80]


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (lambda: budget_maths.parse_period("week"), "period"),
        (lambda: budget_maths.zone("Mars/Olympus"), "time_zone"),
        (lambda: budget_maths.parse_thresholds([0]), "thresholds"),
        (lambda: budget_maths.parse_thresholds([101]), "thresholds"),
        (lambda: budget_maths.parse_thresholds([True]), "thresholds"),
    ],
)
def test_invalid_settings_name_their_field(bad, field):
    with pytest.raises(ValidationFailed) as err:
        bad()
    assert err.value.field == field


def test_thresholds_are_sorted_and_unique():
    assert budget_maths.parse_thresholds([100, 50, 50, 80]) == (50, 80, 100)
    assert budget_maths.parse_thresholds(None) == (50, 80, 100)
