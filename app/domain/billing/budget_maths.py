"""Reference copy of limits/lua/money_reserve.lua's maths: dollar budgets (pure).

Dollar budgets: the maths.

A budget caps what a tenant, or one of its API keys, may cost in a period: a ``day``
or a ``month`` in UTC or a named IANA time zone, or ``total`` (never resets). Amounts
are whole micro-dollars (``MICROS`` per dollar): exact, and what Redis adds up.

Before each provider call its worst-case price is reserved (:func:`worst_case_micros`:
the prompt estimate at the input price plus ``max_tokens`` at the output price, at the
tier of the call's route); a reservation is refused when ``used + reserved + amount``
would pass the limit (:func:`fits`). Soft thresholds (per cent of the limit) are
crossed once per period each (:func:`crossed`). The Redis edge is
:mod:`batchgen.limits.money_budgets`; the storage :mod:`batchgen.store.budget_rows`.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal
from enum import StrEnum
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from batchgen.domain.billing.cost import MILLION, prices
from batchgen.errors import ValidationFailed
from batchgen.registry import ModelSpec, Tier

MICROS = 1_000_000  # micro-dollars per dollar
DEFAULT_THRESHOLDS_PCT = (50, 80, 100)
UTC = dt.UTC


class Period(StrEnum):
    """How often a budget starts again."""

    DAY = "day"
    MONTH = "month"
    TOTAL = "total"  # never: a budget for the tenant's (or key's) whole life


@dataclass(frozen=True)
class BudgetRule:
    """One budget as stored: a hard limit per period and its soft thresholds."""

    limit_micros: int
    period: Period = Period.MONTH
    time_zone: str = "UTC"
    thresholds_pct: tuple[int, ...] = field(default=DEFAULT_THRESHOLDS_PCT)


@dataclass(frozen=True)
class Window:
    """A budget's current period: ``[start, end)`` (``end`` None: ``total``) and its key."""

    key: str  # e.g. "d20261205", "m202612", "total"
    start: dt.datetime | None
    end: dt.datetime | None

    def seconds_left(self, now: dt.datetime) -> float | None:
        return None if self.end is None else max(0.0, (self.end - now).total_seconds())


def to_micros(usd: Decimal | int | float | str) -> int:
    """Dollars as whole micro-dollars, rounded up (a price never comes out lower)."""
    value = Decimal(str(usd)) * MICROS
    return int(value.to_integral_value(rounding=ROUND_CEILING))


def to_usd(micros: int) -> Decimal:
    return Decimal(micros) / MICROS


def worst_case_usd(
    spec: ModelSpec,
    prompt_tokens_est: int,
    max_tokens: int,
    tier: Tier = Tier.STANDARD,
    prompt_margin: float = 1.0,
) -> Decimal:
    """The most a call may cost: the prompt estimate at the input price plus
    ``max_tokens`` at the output price (the larger of output and reasoning), at ``tier``.
    ``prompt_margin`` scales the estimate, for a provider that counts more tokens than
    our tokenizer (and an Anthropic prompt that writes its cache, billed 1.25x input).
    """
    p = prices(spec, tier)
    input_price = p.input * Decimal(str(prompt_margin))
    output_price = max(p.output, p.reasoning)
    return (max(0, prompt_tokens_est) * input_price + max(0, max_tokens) * output_price) / MILLION


def worst_case_micros(
    spec: ModelSpec,
    prompt_tokens_est: int,
    max_tokens: int,
    tier: Tier = Tier.STANDARD,
    prompt_margin: float = 1.0,
) -> int:
    return to_micros(worst_case_usd(spec, prompt_tokens_est, max_tokens, tier, prompt_margin))


def fits(used_micros: int, reserved_micros: int, amount_micros: int, limit_micros: int) -> bool:
    """Whether a reservation of ``amount_micros`` keeps the budget within its limit
    (``money_reserve.lua`` decides the same)."""
    return used_micros + reserved_micros + amount_micros <= limit_micros


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; :class:`ValidationFailed` naming the field otherwise."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValidationFailed(f"unknown time zone {name!r}", field="time_zone") from None


def parse_period(value: str | Period) -> Period:
    try:
        return Period(value)
    except ValueError:
        raise ValidationFailed(
            f"period must be one of day, month, total (got {value!r})", field="period"
        ) from None


def parse_thresholds(values: Iterable[int | float] | None) -> tuple[int, ...]:
    """Soft thresholds in per cent of the limit: whole numbers in (0, 100], sorted."""
    if values is None:
        return DEFAULT_THRESHOLDS_PCT
    out: set[int] = set()
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 100:
            raise ValidationFailed(
                f"thresholds are per cent of the limit, in (0, 100] (got {v!r})",
                field="thresholds",
            )
        out.add(int(v))
    return tuple(sorted(out))


def window(period: Period, time_zone: str, now: dt.datetime) -> Window:
    """The period ``now`` (aware) falls in, in ``time_zone``: its bounds in UTC and its
    key (the local date of its start)."""
    if period is Period.TOTAL:
        return Window("total", None, None)
    local = now.astimezone(zone(time_zone))
    if period is Period.DAY:
        start_date = local.date()
        next_date = start_date + dt.timedelta(days=1)
        key = f"d{start_date:%Y%m%d}"
    else:
        start_date = local.date().replace(day=1)
        next_date = (start_date + dt.timedelta(days=32)).replace(day=1)
        key = f"m{start_date:%Y%m}"
    tz = zone(time_zone)
    # Midnight local (a zone whose midnight is skipped by a DST change: zoneinfo gives
    # the instant after the gap, fold=0), then UTC.
    start = dt.datetime.combine(start_date, dt.time(), tzinfo=tz).astimezone(UTC)
    end = dt.datetime.combine(next_date, dt.time(), tzinfo=tz).astimezone(UTC)
    return Window(key, start, end)


def retry_after_s(win: Window, now: dt.datetime) -> int | None:
    """Whole seconds until the period rolls (None: a ``total`` budget never does)."""
    left = win.seconds_left(now)
    return None if left is None else max(1, math.ceil(left))


def crossed(
    before_micros: int, after_micros: int, limit_micros: int, thresholds_pct: Sequence[int]
) -> list[int]:
    """The thresholds (per cent) that spending from ``before`` to ``after`` reached."""
    if limit_micros <= 0:
        return [t for t in thresholds_pct if after_micros > before_micros]
    return [
        t for t in thresholds_pct if before_micros * 100 < t * limit_micros <= after_micros * 100
    ]


def reached(used_micros: int, limit_micros: int, thresholds_pct: Sequence[int]) -> list[int]:
    """Every threshold that ``used_micros`` has reached (an alert is sent once each)."""
    if limit_micros <= 0:
        return list(thresholds_pct)
    return [t for t in thresholds_pct if t * limit_micros <= used_micros * 100]


def used_pct(used_micros: int, limit_micros: int) -> float:
    return 100.0 if limit_micros <= 0 else 100.0 * used_micros / limit_micros
