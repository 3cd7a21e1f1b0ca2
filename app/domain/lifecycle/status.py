"""Status values shared by the models, the API and the tasks, and their legal moves.

This module is the one source of the open and terminal sets and of the moves an
item may make: :mod:`batchgen.store.items` declares each of its state moves
against :data:`TRANSITIONS` (and its WHERE clause is built from the declared
sources), and the database refuses any status value not listed here (a CHECK
constraint, migration 0004).
"""

from __future__ import annotations

from enum import StrEnum

from batchgen.errors import ValidationFailed


class ItemStatus(StrEnum):
    PENDING = "pending"  # stored, waiting for the dispatcher
    # waiting for, or in, a job of the provider's own Batch API (batchgen.domain.scheduling.offload)
    OFFLOADED = "offloaded"
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


class JobStatus(StrEnum):
    """A provider job (``provider_jobs``): a batch of items sent to the provider's own
    Batch API (batchgen.worker.offload_jobs)."""

    CREATING = "creating"  # recorded with its items; the create call is under way
    RUNNING = "running"  # the provider has it (its id recorded); polled until it ends
    # The create call's answer was lost and the provider cannot list the job until it
    # ends (Anthropic): looked for at every tick; its items went online at its cutoff.
    UNCONFIRMED = "unconfirmed"
    ENDED = "ended"  # every row read and recorded
    FAILED = "failed"  # refused by the provider as a whole: no row ran
    ABANDONED = "abandoned"  # its create never reached the provider: items re-planned


OPEN_JOBS = frozenset({JobStatus.CREATING, JobStatus.RUNNING, JobStatus.UNCONFIRMED})


class Priority(StrEnum):
    INTERACTIVE = "interactive"
    BULK = "bulk"
    # A synchronous call (POST /v1/chat/completions, /v1/messages): a one-item batch
    # someone is waiting on. Never a batch's choice: the API sets it.
    CALL = "call"

    @property
    def rank(self) -> int:
        """Sort key within a tenant: calls first, then interactive work, then bulk."""
        return _RANKS[self]


# The rank of a call's item (the trigger of migration 0006 notifies its end by it).
CALL_RANK = -1
_RANKS = {Priority.CALL: CALL_RANK, Priority.INTERACTIVE: 0, Priority.BULK: 1}


# A batch whose caller names no priority and allows it at least this long is bulk: a
# 24 h batch (the providers' Batch API window, the SDKs' only completion_window) may
# then go to the half-price Batch APIs without the caller asking for priority=bulk.
BULK_WINDOW_S = 24 * 3600


def sdk_priority(value: str | Priority | None, window_s: float) -> Priority:
    """The priority of an SDK batch: the caller's (:func:`parse_priority`), else bulk
    when its completion window is at least ``BULK_WINDOW_S``, else interactive."""
    if value is not None:
        return parse_priority(value)
    return Priority.BULK if window_s >= BULK_WINDOW_S else Priority.INTERACTIVE


def parse_priority(value: str | Priority) -> Priority:
    """A batch's priority from the caller (``interactive`` or ``bulk``);
    :class:`ValidationFailed` naming the field otherwise."""
    try:
        priority = Priority(value)
    except ValueError:
        priority = Priority.CALL
    if priority is Priority.CALL:
        raise ValidationFailed("priority must be 'interactive' or 'bulk'", field="priority")
    return priority


TERMINAL = frozenset(
    {ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.EXPIRED, ItemStatus.CANCELLED}
)
OPEN = frozenset(ItemStatus) - TERMINAL
# Items holding a place in their model's dispatch window.
IN_FLIGHT = frozenset({ItemStatus.QUEUED, ItemStatus.RUNNING})


def values(statuses: frozenset[ItemStatus]) -> list[str]:
    """The statuses as sorted plain strings (for SQL ``IN`` lists and parameters)."""
    return sorted(s.value for s in statuses)


# Every legal move of an item. Anything else is a bug or a stale message.
TRANSITIONS: dict[ItemStatus, frozenset[ItemStatus]] = {
    ItemStatus.PENDING: frozenset(
        {
            ItemStatus.QUEUED,  # released by the dispatcher
            ItemStatus.EXPIRED,  # deadline passed before it ran
            ItemStatus.FAILED,  # deadline passed while its dollar budget held it
            ItemStatus.CANCELLED,  # its batch was cancelled
            ItemStatus.SUCCEEDED,  # a late answer of an attempt the sweep took back
        }
    ),
    ItemStatus.OFFLOADED: frozenset(
        {
            ItemStatus.SUCCEEDED,  # its row of the provider's job answered
            ItemStatus.PENDING,  # back online: the job failed, expired, ran late or errored it
            ItemStatus.CANCELLED,  # its batch was cancelled
        }
    ),
    ItemStatus.QUEUED: frozenset(
        {
            ItemStatus.RUNNING,  # claimed by a worker
            ItemStatus.PENDING,  # lease expired (lost message)
            ItemStatus.EXPIRED,
            ItemStatus.CANCELLED,
            ItemStatus.SUCCEEDED,  # a late answer of an earlier attempt
        }
    ),
    ItemStatus.RUNNING: frozenset(
        {
            ItemStatus.SUCCEEDED,
            ItemStatus.FAILED,
            ItemStatus.EXPIRED,
            ItemStatus.CANCELLED,
            ItemStatus.PENDING,  # retry after an error, a long budget wait, a dead worker
            ItemStatus.QUEUED,  # a short budget wait, or handed back unsent: the task retries
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
    open_items = sum(n for s, n in counts.items() if s in OPEN)
    if open_items:
        return BatchStatus.CANCELLING if cancel_requested else BatchStatus.IN_PROGRESS
    if cancel_requested:
        return BatchStatus.CANCELLED
    if counts.get(ItemStatus.EXPIRED, 0) and not any(
        n for s, n in counts.items() if s is not ItemStatus.EXPIRED
    ):
        return BatchStatus.EXPIRED
    return BatchStatus.COMPLETED
