"""How busy the host's CPUs have been since a mark (psutil's counters of all CPUs).

A pack of short calls that has run its time with calls no longer short hands the
rest back so that they overlap on other threads
(:func:`batchgen.worker.pack_calls.run_together`). When the host's CPUs were all busy
meanwhile, its calls were slow because the worker, PostgreSQL, Redis and the rest
waited for a CPU, not because the provider turned slow: more calls at once would only
wait the same, and the messages of a hand-back cost CPU of their own.
"""

from __future__ import annotations

from typing import NamedTuple

import psutil

__all__ = ["CpuMark", "busy_share", "mark"]

# Counted in "user" already (Linux): left out of the total, as psutil.cpu_percent does.
_GUEST_FIELDS = ("guest", "guest_nice")
_IDLE_FIELDS = ("idle", "iowait")


class CpuMark(NamedTuple):
    """CPU seconds of all the host's CPUs: busy, and in all."""

    busy_s: float
    total_s: float


def mark() -> CpuMark | None:
    """The host's counters now; None where they cannot be read."""
    try:
        times = psutil.cpu_times()._asdict()
    except (OSError, RuntimeError, AttributeError):
        return None
    total_s = sum(times.values()) - sum(times.get(f, 0.0) for f in _GUEST_FIELDS)
    idle_s = sum(times.get(f, 0.0) for f in _IDLE_FIELDS)
    return CpuMark(total_s - idle_s, total_s)


def busy_share(since: CpuMark | None) -> float | None:
    """The share of the host's CPU time spent busy since ``since`` (1.0: every CPU all
    the time); None: no mark, unreadable counters, or no time counted since."""
    if since is None:
        return None
    now = mark()
    if now is None or now.total_s <= since.total_s:
        return None
    return min(1.0, max(0.0, (now.busy_s - since.busy_s) / (now.total_s - since.total_s)))
