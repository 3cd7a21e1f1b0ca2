"""What became of one delivery of an item: the worker task's answer."""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.store.items import Ticket

# Outcomes after which the item no longer holds a place in its model's window.
FREES_PLACE = frozenset({"succeeded", "failed", "expired", "cancelled", "deferred", "retry"})


@dataclass(frozen=True)
class Verdict:
    """What happened to one delivery. ``countdown_s`` is set for a budget wait:
    the task retries itself after that long without using up an attempt."""

    outcome: str
    countdown_s: float | None = None
    model: str | None = None
    # How long the provider call took (None: no call was made), for the pack size.
    call_s: float | None = None
    # The ticket the item's next delivery carries, when it is not the one this delivery
    # had (a failover: the next attempt, and the deployment to avoid).
    ticket: Ticket | None = None

    @property
    def frees_place(self) -> bool:
        """The item left its model's dispatch window: a refill may release another."""
        return self.outcome in FREES_PLACE
