"""Durations and deadlines (pure)."""

from __future__ import annotations

import datetime as dt
import re

from batchgen.errors import ValidationFailed

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
MAX_WINDOW_S = 7 * 86400


def parse_duration_s(text: str | int | float, field: str = "completion_window") -> float:
    """``"24h"``, ``"30m"``, ``"90s"``, ``"2d"``, ``"500ms"`` or a number of seconds."""
    if isinstance(text, bool):
        raise ValidationFailed(f"{field}: expected a duration like '24h'", field=field)
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        match = _DURATION.match(text)
        if not match:
            raise ValidationFailed(
                f"{field}: {text!r} is not a duration (use e.g. '24h', '30m', '90s')", field=field
            )
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds <= 0 or seconds > MAX_WINDOW_S:
        raise ValidationFailed(
            f"{field}: must be between 0 and {MAX_WINDOW_S // 86400} days", field=field
        )
    return seconds


def format_duration(seconds: float) -> str:
    """A duration as :func:`parse_duration_s` reads it, in its largest whole unit
    (``86400`` → ``"24h"``, as OpenAI writes a completion window; ``90`` → ``"90s"``)."""
    whole = int(seconds)
    if whole != seconds:
        return f"{int(seconds * 1000)}ms"
    for unit, size in (("h", 3600), ("m", 60)):
        if whole and whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def host_now() -> dt.datetime:
    """This host's wall clock (UTC). Never compare it with a time set by PostgreSQL:
    hosts drift; deadlines and leases use :func:`carried_forward` instead."""
    return dt.datetime.now(dt.UTC)


def carried_forward(read_at: dt.datetime, read_mono_s: float, mono_s: float) -> dt.datetime:
    """A clock read once at ``read_at`` (when ``time.monotonic()`` was ``read_mono_s``),
    carried forward to the monotonic instant ``mono_s``."""
    return read_at + dt.timedelta(seconds=max(0.0, mono_s - read_mono_s))


def time_left_s(deadline: dt.datetime, now: dt.datetime) -> float:
    """Seconds until ``deadline`` (negative once passed)."""
    return (deadline - now).total_seconds()


def call_timeout_s(configured_s: float, deadline: dt.datetime, now: dt.datetime) -> float:
    """A provider call may take no longer than its own timeout nor the time left."""
    return max(0.0, min(configured_s, time_left_s(deadline, now)))
