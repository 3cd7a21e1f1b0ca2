"""The ways the tests wait: on a condition, with a deadline that names what was
awaited (never a fixed sleep: a loaded machine is slow, not wrong), and, where a
stretch of time is itself the scenario (an outage's length, a time in which nothing
may happen), :func:`hold`, which names it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# A wait that names no interval asks soon (a condition met at once is seen at once),
# then less and less often, up to POLL_MAX_S apart: a long wait asks four times a second,
# not ten (most conditions query PostgreSQL, the API or the simulator).
POLL_FIRST_S = 0.02
POLL_GROWTH = 1.5
POLL_MAX_S = 0.25


def next_poll_s(previous_s: float) -> float:
    """The wait after ``previous_s`` when the caller named no interval."""
    return min(POLL_MAX_S, previous_s * POLL_GROWTH)


def poll_until(condition: Callable[[], Any], timeout_s: float, poll_s: float | None = None) -> Any:
    """Poll ``condition`` until it returns something truthy, or until ``timeout_s``
    have passed; returns its last value (falsy then): for a caller that goes on, and
    says how things stood, when the time is up. ``poll_s``: a fixed interval (a caller
    that samples a state); by default the interval grows (:func:`next_poll_s`)."""
    deadline = time.monotonic() + timeout_s
    interval_s = POLL_FIRST_S if poll_s is None else poll_s
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
        if poll_s is None:
            interval_s = next_poll_s(interval_s)


def wait_until(
    condition: Callable[[], Any],
    timeout_s: float,
    what: str | Callable[[], str],
    poll_s: float | None = None,
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` (or what
    it returns then, for a message that says how things stood)."""
    value = poll_until(condition, timeout_s, poll_s)
    if not value:
        said = what if isinstance(what, str) else what()
        raise AssertionError(f"timed out after {timeout_s}s waiting for {said}")
    return value


def hold(seconds: float, why: str) -> None:
    """Let ``seconds`` pass (none if not positive) where the length of time is what the
    scenario is made of, not a wait for something: an outage, a lease's lapse, rows
    that finish on a timeline, or a time in which nothing may happen. ``why`` names
    it (and says so to a reader of a hung test's traceback)."""
    if seconds > 0:
        time.sleep(seconds)
