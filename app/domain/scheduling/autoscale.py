"""The autoscaling signal: how much work could start now, and how many worker slots
it needs, per model and per model group (the worker queue ``llm.<group>``).

Items wait in PostgreSQL and in budget waits, not in the broker's list, so a
queue-length scaler sees almost nothing while thousands are runnable. This module
turns what the store and Redis say (ready items, slots held, the budget's free tokens,
the observed call time) into the numbers an autoscaler reads
(``batchgen_runnable_items`` and ``batchgen_worker_slots_wanted``, docs/operations.md
"Kubernetes"). A model that is budget-bound asks for no more slots than its budget can
keep busy: its tokens/min let ``N`` calls a minute, each holds a slot for its call time,
so ``ceil(N * call_s / 60)`` slots (Little's law) are all it can use. An idle model asks
for none.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

SECONDS_PER_MIN = 60.0


@dataclass(frozen=True)
class ModelLoad:
    """One model's state at a scrape."""

    ready_items: int  # pending and due, or queued for a worker: could start if let
    running_calls: int  # concurrency slots held now
    max_concurrency: int
    tokens_per_min: int
    requests_per_min: int
    tokens_per_item: float  # mean estimated tokens (prompt + max output) of a ready item
    budget_free_tokens: float  # tokens the budget would grant now
    call_s: float | None  # observed mean call time; None: none observed yet
    # The provider budget it draws on; models sharing one share its tokens and requests.
    budget_key: str | None = None


@dataclass(frozen=True)
class Demand:
    """Work that could start now, and the worker slots (threads) the model can use."""

    runnable_items: int
    worker_slots: int

    def __add__(self, other: Demand) -> Demand:
        return Demand(
            self.runnable_items + other.runnable_items, self.worker_slots + other.worker_slots
        )


IDLE = Demand(0, 0)


def budget_slots(
    tokens_per_min: int, requests_per_min: int, tokens_per_item: float, call_s: float | None
) -> int | None:
    """The most slots the budget keeps busy: its calls a minute (tokens and requests)
    times the call time, in minutes, rounded up; at least one. None: no call time
    observed yet, so no bound from the budget."""
    if call_s is None or call_s <= 0:
        return None
    calls_per_min = min(float(requests_per_min), tokens_per_min / max(tokens_per_item, 1.0))
    return max(1, math.ceil(calls_per_min * call_s / SECONDS_PER_MIN))


def _budget_items(load: ModelLoad) -> int:
    """Ready items the budget's free tokens would let start now."""
    return math.floor(max(load.budget_free_tokens, 0.0) / max(load.tokens_per_item, 1.0))


def _budget_cap(load: ModelLoad) -> int | None:
    return budget_slots(
        load.tokens_per_min, load.requests_per_min, load.tokens_per_item, load.call_s
    )


def demand(load: ModelLoad) -> Demand:
    """What one model asks of the autoscaler.

    ``runnable_items``: ready items that could start now, within the free slots and the
    budget's free tokens. ``worker_slots``: the slots it can use, its ready and running
    calls capped by ``max_concurrency`` and by what its budget can keep busy; 0 when it
    has nothing ready or running."""
    if load.ready_items <= 0 and load.running_calls <= 0:
        return IDLE
    ready = max(load.ready_items, 0)
    free_slots = max(load.max_concurrency - load.running_calls, 0)
    runnable = min(ready, free_slots, _budget_items(load))
    wanted = min(ready + max(load.running_calls, 0), load.max_concurrency)
    cap = _budget_cap(load)
    if cap is not None:
        wanted = min(wanted, cap)
    return Demand(runnable, wanted)


def _shared_demand(loads: list[ModelLoad]) -> Demand:
    """Models drawing on one budget: their sum, but no more than the one budget lets
    start or keeps busy (the largest of what it would give any one of them alone)."""
    total = IDLE
    for load in loads:
        total = total + demand(load)
    busy = [load for load in loads if demand(load) != IDLE]
    if len(busy) < 2:
        return total
    caps = [_budget_cap(load) for load in busy]
    slots = total.worker_slots
    if all(cap is not None for cap in caps):
        slots = min(slots, max(cap for cap in caps if cap is not None))
    return Demand(min(total.runnable_items, max(map(_budget_items, busy))), slots)


def group_demand(loads: Iterable[ModelLoad]) -> Demand:
    """A worker group's demand: the sum over its models (each has its own slots; the
    group's workers serve them all), models sharing a budget counted as one budget."""
    shared: dict[str, list[ModelLoad]] = defaultdict(list)
    total = IDLE
    for load in loads:
        if load.budget_key is None:
            total = total + demand(load)
        else:
            shared[load.budget_key].append(load)
    for same_budget in shared.values():
        total = total + _shared_demand(same_budget)
    return total
