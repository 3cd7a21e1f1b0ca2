"""Reference copy of limits/lua/budget_reserve.lua's reserve of slots for sync calls.

A reserve of a model's concurrency slots for synchronous calls (pure).

Behind a bulk backlog every slot of a model is held by batch work, so a
synchronous call (someone waits on it) would wait for one of those calls to end
before its own can start. While sync calls have been seen on a model recently,
batch work therefore leaves a few of its slots free for them: the next call
starts at once, as on an idle model. A model without recent calls lends the
reserve to batch work, so it costs nothing when nobody calls.

The reserve is of the model's slots (every deployment's together, as the calls'
claims and the tenants' shares count them), and slots that sync calls already
hold count in it: with one call running in a reserve of one, batch work may take
every other slot. Sync calls waiting for a slot claim one each on top
(``lua/budget_reserve.lua``); the reserve is the floor of what batch work
leaves them. ``lua/budget_reserve.lua`` applies :func:`slots_withheld` in the
same atomic step that takes a slot.
"""

from __future__ import annotations


def reserve_of(limit: int, reserved: int) -> int:
    """The reserve of a model of ``limit`` slots: ``reserved``, but never every slot
    (batch work keeps at least one) and never below zero."""
    return max(0, min(reserved, limit - 1))


def slots_withheld(
    *, limit: int, reserved: int, calls_recent: bool, calls_holding: int, calls_waiting: int
) -> int:
    """How many of a model's ``limit`` slots batch work may not take now.

    Each sync call waiting for a slot claims the next free one (``calls_waiting``);
    while calls were seen recently (``calls_recent``), the reserve less the slots sync
    calls hold (``calls_holding``) is kept besides; the waiting calls fill it first,
    so the larger of the two is withheld, not their sum."""
    keep = reserve_of(limit, reserved) - max(0, calls_holding) if calls_recent else 0
    return max(0, calls_waiting, keep)


def batch_may_take(
    *,
    limit: int,
    held: int,
    reserved: int,
    calls_recent: bool,
    calls_holding: int,
    calls_waiting: int,
) -> bool:
    """Whether batch work may take one more of a model's ``limit`` slots, ``held`` of
    them being held (by anyone)."""
    withheld = slots_withheld(
        limit=limit,
        reserved=reserved,
        calls_recent=calls_recent,
        calls_holding=calls_holding,
        calls_waiting=calls_waiting,
    )
    return held < limit - withheld
