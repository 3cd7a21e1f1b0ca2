"""Offloading bulk work to a provider's own Batch API: the pure rules.

A model whose registry entry declares ``offload = true`` has an offline route
(:class:`batchgen.registry.OfflineRoute`): the provider's batch API, at its batch
prices, with a typical ``turnaround_s`` and bounds per job. Whether an item goes
there is decided twice, by the same numbers:

- **at submit** (:func:`wants_offline`): a batch's mode (``offload``: ``auto``,
  ``never``, ``always``), its priority and the time its deadline leaves;
- **when its job is planned** (:func:`keeps_offline`): now that the job's size is
  known, the time needed to run the job online if the provider is late
  (:func:`online_time_s`) is kept back from the deadline.

A job still running at the provider at its cutoff (:func:`cutoff_at`: deadline −
online time needed) is cancelled there and its items run online.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum

from batchgen.domain.lifecycle.status import Priority
from batchgen.errors import ValidationFailed


class OffloadMode(StrEnum):
    AUTO = "auto"  # bulk work whose deadline leaves room for the provider's turnaround
    NEVER = "never"  # always online
    ALWAYS = "always"  # every item of a model with an offline route, whatever its priority


class Route(StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"


def parse_offload(value: str | OffloadMode | None) -> OffloadMode:
    """A batch's ``offload`` option; :class:`ValidationFailed` naming the field otherwise."""
    if value is None:
        return OffloadMode.AUTO
    try:
        return OffloadMode(value)
    except ValueError:
        raise ValidationFailed(
            f"offload must be one of auto, never, always (got {value!r})", field="offload"
        ) from None


@dataclass(frozen=True)
class OfflineWindow:
    """The numbers of a model's offline route the rules need."""

    turnaround_s: float  # how long the provider typically takes for a job
    fallback_s: float  # time always kept back to run an item online after a late job


def wants_offline(
    *,
    mode: OffloadMode,
    priority: Priority,
    window: OfflineWindow | None,
    deadline_left_s: float,
) -> bool:
    """At submit: does this item wait for a provider job?

    Never for a model without an offline route, a synchronous call or ``never``.
    ``always``: whenever the deadline leaves more than ``fallback_s``. ``auto``: bulk
    items whose deadline leaves ``turnaround_s + fallback_s`` or more.
    """
    if window is None or mode is OffloadMode.NEVER or priority is Priority.CALL:
        return False
    if mode is OffloadMode.ALWAYS:
        return deadline_left_s > window.fallback_s
    return priority is Priority.BULK and deadline_left_s >= window.turnaround_s + window.fallback_s


def online_time_s(tokens: int, tokens_per_min: int, fallback_s: float) -> float:
    """Time to keep back for running ``tokens`` of work online at the model's rate,
    should the provider's job be late: ``fallback_s`` plus the drain time."""
    return fallback_s + tokens * 60.0 / tokens_per_min


def keeps_offline(
    *, mode: OffloadMode, window: OfflineWindow, deadline_left_s: float, online_s: float
) -> bool:
    """When its job is planned: does the item still go offline? ``online_s`` is
    :func:`online_time_s` of the job it would join."""
    if mode is OffloadMode.ALWAYS:
        return deadline_left_s > online_s
    return deadline_left_s >= window.turnaround_s + online_s


def cutoff_at(deadline_at: dt.datetime, online_s: float) -> dt.datetime:
    """When a job still running at the provider is cancelled there and run online."""
    return deadline_at - dt.timedelta(seconds=online_s)


@dataclass(frozen=True)
class Row:
    """One item as a job's bounds see it."""

    item_id: int
    tokens: int  # what the provider's enqueued-token limit counts (prompt + max_tokens)
    size_bytes: int  # its line in the job's input file


@dataclass(frozen=True)
class JobBounds:
    max_requests: int
    max_bytes: int
    free_tokens: int | None  # room left under the enqueued-token limit (None: no limit)


def plan_jobs(rows: Sequence[Row], bounds: JobBounds) -> list[list[Row]]:
    """Split ``rows`` (in order) into jobs within the bounds; rows that do not fit under
    the enqueued-token room wait (they are not returned). A single row larger than a
    job's byte bound is never planned: the caller runs it online."""
    jobs: list[list[Row]] = []
    current: list[Row] = []
    size = 0
    free = bounds.free_tokens
    for row in rows:
        if row.size_bytes > bounds.max_bytes:
            continue
        if free is not None and row.tokens > free:
            break  # in order: later rows wait for room too
        if current and (
            len(current) >= bounds.max_requests or size + row.size_bytes > bounds.max_bytes
        ):
            jobs.append(current)
            current, size = [], 0
        current.append(row)
        size += row.size_bytes
        if free is not None:
            free -= row.tokens
    if current:
        jobs.append(current)
    return jobs


def too_few(
    jobs: list[list[Row]], min_requests: int, all_planned: bool
) -> tuple[list[list[Row]], list[Row]]:
    """The jobs the provider takes (each of ``min_requests`` rows or more: Bedrock's
    batch inference wants 100), and the rows of the smaller ones: they run online when
    every waiting row was planned (``all_planned``: a remainder), else they are in
    neither (they wait for a later tick, beside the rows the token room held back)."""
    kept = [job for job in jobs if len(job) >= min_requests]
    small = [row for job in jobs if len(job) < min_requests for row in job]
    return kept, small if all_planned else []


def poll_delay_s(polls: int, first_s: float, max_s: float) -> float:
    """Wait before the next poll of a job polled ``polls`` times: doubling from
    ``first_s`` up to ``max_s``."""
    return float(min(max_s, first_s * 2 ** min(polls, 30)))


def saved_usd(online_cost_usd: Decimal, offline_cost_usd: Decimal) -> Decimal:
    """What an answer bought offline saved against the online price."""
    return online_cost_usd - offline_cost_usd
