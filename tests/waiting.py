"""The one way the tests wait: on a condition, with a deadline that names what was
awaited (never a fixed sleep: a loaded machine is slow, not wrong)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(
    condition: Callable[[], Any],
    timeout_s: float,
    what: str | Callable[[], str],
    poll_s: float = 0.1,
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` (or what
    it returns then, for a message that says how things stood)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"timed out after {timeout_s}s waiting for {said}")
        time.sleep(poll_s)
