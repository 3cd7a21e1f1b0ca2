"""Status values shared by the models, the API and the tasks, and their legal moves."""

from __future__ import annotations

from enum import StrEnum


class ItemStatus(StrEnum):
    PENDING = "pending"  # stored, waiting for the dispatcher
    QUEUED = "queued"  # released to the broker with a lease
    RUNNING = "running"  # claimed by a worker, provider call under way
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


class BatchStatus(StrEnum):
    IN_PROGRESS = "in_progress"
    CANCELLING = "cancelling"  # cancel asked, some calls still running
    COMPLETED = "completed"  # every item terminal, not cancelled, not all expired
    EXPIRED = "expired"  # every item expired: none of it ran
    CANCELLED = "cancelled"


class Priority(StrEnum):
    INTERACTIVE = "interactive"
    BULK = "bulk"

    @property
    def rank(self) -> int:
        """Sort key within a tenant: interactive work is released first."""
        return 0 if self is Priority.INTERACTIVE else 1


TERMINAL = frozenset(
    {ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.EXPIRED, ItemStatus.CANCELLED}
)
ACTIVE = frozenset({ItemStatus.QUEUED, ItemStatus.RUNNING})

# Every legal move of an item. Anything else is a bug or a stale message.
TRANSITIONS: dict[ItemStatus, frozenset[ItemStatus]] = {
    ItemStatus.PENDING: frozenset(
        {ItemStatus.QUEUED, ItemStatus.EXPIRED, ItemStatus.CANCELLED, ItemStatus.FAILED}
    ),
    ItemStatus.QUEUED: frozenset(
        {
            ItemStatus.RUNNING,
            ItemStatus.PENDING,  # lease expired (lost message) or budget wait handed back
            ItemStatus.EXPIRED,
            ItemStatus.CANCELLED,
        }
    ),
    ItemStatus.RUNNING: frozenset(
        {
            ItemStatus.SUCCEEDED,
            ItemStatus.FAILED,
            ItemStatus.EXPIRED,
            ItemStatus.CANCELLED,
            ItemStatus.PENDING,  # retry after a transient error, or a dead worker's lease
        }
    ),
    ItemStatus.SUCCEEDED: frozenset(),
    ItemStatus.FAILED: frozenset(),
    ItemStatus.EXPIRED: frozenset(),
    ItemStatus.CANCELLED: frozenset(),
}


def can_move(src: ItemStatus, dst: ItemStatus) -> bool:
    """True when an item may go from ``src`` to ``dst``."""
    return dst in TRANSITIONS[src]


def batch_status(counts: dict[ItemStatus, int], cancel_requested: bool) -> BatchStatus:
    """A batch's status from its item counts: finished when no item is left to run;
    ``expired`` when every item expired (partly expired batches are ``completed``
    and say so in their counts)."""
    open_items = sum(n for s, n in counts.items() if s not in TERMINAL)
    if open_items:
        return BatchStatus.CANCELLING if cancel_requested else BatchStatus.IN_PROGRESS
    if cancel_requested:
        return BatchStatus.CANCELLED
    if counts.get(ItemStatus.EXPIRED, 0) and not any(
        n for s, n in counts.items() if s is not ItemStatus.EXPIRED
    ):
        return BatchStatus.EXPIRED
    return BatchStatus.COMPLETED
