"""What the dashboard shows, decided without I/O: money as money, a batch's progress by
status, its rate and time left, and series turned into SVG paths for inline charts
(server-rendered, no script, no CDN: the page works offline).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

from batchgen.domain.lifecycle.status import OPEN, ItemStatus

CENT = Decimal("0.01")
SUB_CENT = Decimal("0.0001")
MAX_BAR_W = 56  # a bar chart's bars at most (SVG units), however few
# The progress bar's segments, left to right: what ended well first, what is still open last.
BAR_ORDER = (
    ItemStatus.SUCCEEDED,
    ItemStatus.FAILED,
    ItemStatus.EXPIRED,
    ItemStatus.CANCELLED,
    ItemStatus.RUNNING,
    ItemStatus.QUEUED,
    ItemStatus.OFFLOADED,
    ItemStatus.PENDING,
)


def format_usd(value: Decimal | str | float | int) -> str:
    """An amount in US dollars as money: ``$12.35``, to the cent; a non-zero amount
    under a cent to four places (``$0.0042``), and ``<$0.0001`` below that."""
    amount = Decimal(str(value))
    sign = "-" if amount < 0 else ""
    magnitude = abs(amount)
    if magnitude == 0:
        return "$0.00"
    if magnitude < CENT:
        if magnitude < SUB_CENT / 2:
            return f"{sign}<$0.0001"
        return f"{sign}${magnitude.quantize(SUB_CENT, ROUND_HALF_UP)}"
    return f"{sign}${magnitude.quantize(CENT, ROUND_HALF_UP):,}"


@dataclass(frozen=True)
class Segment:
    status: str
    items: int
    pct: float  # of the bar's width


def bar_segments(counts: Mapping[str, int]) -> list[Segment]:
    """The progress bar as one segment per item status present, in :data:`BAR_ORDER`,
    so a cancelled batch (grey) never looks like a completed one (green)."""
    total = sum(counts.get(s.value, 0) for s in BAR_ORDER)
    if not total:
        return []
    return [
        Segment(s.value, n, round(100 * n / total, 2))
        for s in BAR_ORDER
        if (n := counts.get(s.value, 0))
    ]


# Ends an item reaches without its request running to an answer or an error: a
# batch's progress does not count them as done, and names them beside it.
UNRUN_ENDS = (ItemStatus.CANCELLED, ItemStatus.EXPIRED)


@dataclass(frozen=True)
class Progress:
    """A batch's progress as its table reads it: ``done`` of ``total`` items ran to an
    end (succeeded or failed); ``unrun``, the items that ended without running, by
    status, so a cancelled batch reads ``0/2000 · cancelled 2000``, not ``2000/2000``."""

    done: int
    total: int
    unrun: dict[str, int]


def progress(counts: Mapping[str, int]) -> Progress:
    """The progress of a batch of these counts by status (``total`` among them)."""
    done = counts.get(ItemStatus.SUCCEEDED.value, 0) + counts.get(ItemStatus.FAILED.value, 0)
    unrun = {s.value: n for s in UNRUN_ENDS if (n := counts.get(s.value, 0))}
    total = counts.get("total", sum(counts.get(s.value, 0) for s in ItemStatus))
    return Progress(done, total, unrun)


def open_items(counts: Mapping[str, int]) -> int:
    """Items of a batch not yet ended."""
    return sum(counts.get(s.value, 0) for s in OPEN)


def rate_per_min(finished: int, window_s: float, age_s: float) -> float:
    """Items per minute from the ``finished`` items of the last ``window_s`` seconds, over
    the part of that window the batch has existed (``age_s``): a batch a few seconds old
    has its true rate, not one diluted over minutes it did not exist."""
    span_s = max(min(window_s, age_s), 1.0)
    return 60.0 * finished / span_s


def time_left_s(open_count: int, items_per_min: float) -> float | None:
    """Seconds until the open items are done at the recent rate; None when nothing has
    finished lately (no estimate), 0 when nothing is left."""
    if open_count <= 0:
        return 0.0
    if items_per_min <= 0:
        return None
    return 60.0 * open_count / items_per_min


def format_duration_s(seconds: float | None) -> str:
    """``2 h 05 min``, ``4 min 10 s``, ``12 s``; ``unknown`` for None."""
    if seconds is None:
        return "unknown"
    whole = int(math.ceil(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


# Charts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Box:
    """The plot area inside an SVG of ``width`` x ``height`` (user units)."""

    width: float = 480
    height: float = 160
    left: float = 44
    right: float = 8
    top: float = 8
    bottom: float = 22

    @property
    def plot_w(self) -> float:
        return self.width - self.left - self.right

    @property
    def plot_h(self) -> float:
        return self.height - self.top - self.bottom


@dataclass(frozen=True)
class Line:
    name: str
    path: str  # an SVG path's ``d``
    last: float


@dataclass(frozen=True)
class Tick:
    y: float  # in SVG units
    label: str


@dataclass(frozen=True)
class LineChart:
    box: Box
    lines: list[Line]
    ticks: list[Tick]
    x_labels: list[tuple[float, str]]
    limit_y: float | None  # where a horizontal limit line goes, if any
    limit_label: str


@dataclass(frozen=True)
class Bar:
    label: str
    x: float
    y: float
    width: float
    height: float
    value_label: str


def nice_max(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^n at or above ``value`` (an axis' top)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        top = step * 10.0**exponent
        if top >= value * (1 - 1e-9):
            return float(top)
    return float(10.0 ** (exponent + 1))  # pragma: no cover - the loop ends at 10


def _fmt(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:g}M"
    if value >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def _xy(box: Box, i: int, n: int, value: float, top: float) -> tuple[float, float]:
    x = box.left + (box.plot_w * i / (n - 1) if n > 1 else box.plot_w / 2)
    y = box.top + box.plot_h * (1 - min(value, top) / top)
    return round(x, 1), round(y, 1)


def line_chart(
    series: Mapping[str, Sequence[float]],
    *,
    box: Box | None = None,
    limit: float | None = None,
    limit_label: str = "limit",
    x_labels: Sequence[str] = (),
) -> LineChart:
    """Series of equal length (one value per step, oldest first) as SVG paths in
    ``box``, on a common y axis from 0 to a round top above the largest value and the
    ``limit`` (drawn as a line of its own, e.g. a model's tokens per minute).
    ``x_labels`` go under the first, middle and last step."""
    box = box or Box()
    n = max((len(v) for v in series.values()), default=0)
    peak = max([*(max(v, default=0.0) for v in series.values()), limit or 0.0, 0.0])
    top = nice_max(peak)
    lines = []
    for name, values in series.items():
        points = [_xy(box, i, n, float(v), top) for i, v in enumerate(values)]
        path = " ".join(f"{'M' if i == 0 else 'L'}{x:g},{y:g}" for i, (x, y) in enumerate(points))
        lines.append(Line(name, path, float(values[-1]) if values else 0.0))
    ticks = [Tick(round(box.top + box.plot_h * (1 - f), 1), _fmt(top * f)) for f in (0, 0.5, 1)]
    labels: list[tuple[float, str]] = []
    if x_labels and n:
        picks = sorted({0, (len(x_labels) - 1) // 2, len(x_labels) - 1})
        labels = [(_xy(box, i, len(x_labels), 0, top)[0], x_labels[i]) for i in picks]
    limit_y = _xy(box, 0, 1, limit, top)[1] if limit else None
    return LineChart(box, lines, ticks, labels, limit_y, limit_label)


def bar_chart(
    values: Iterable[tuple[str, float]],
    *,
    box: Box | None = None,
    label_of: Callable[[float], str] = _fmt,
) -> list[Bar]:
    """Labelled values as vertical bars from 0 to a round top over the largest one,
    each with its value as ``label_of`` writes it."""
    box = box or Box()
    pairs = list(values)
    if not pairs:
        return []
    top = nice_max(max(v for _, v in pairs))
    slot = box.plot_w / len(pairs)
    width = min(slot * 0.7, MAX_BAR_W)
    bars = []
    for i, (label, value) in enumerate(pairs):
        height = box.plot_h * max(value, 0) / top
        bars.append(
            Bar(
                label=label,
                x=round(box.left + i * slot + (slot - width) / 2, 1),
                y=round(box.top + box.plot_h - height, 1),
                width=round(width, 1),
                height=round(height, 1),
                value_label=label_of(value),
            )
        )
    return bars
