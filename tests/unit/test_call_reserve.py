"""The calls' reserve of a model's slots (app/domain/scheduling/call_reserve.py): its rule, and a
model's slots driven through it by random calls and batch work."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batchgen.domain.scheduling.call_reserve import batch_may_take, reserve_of, slots_withheld


def test_the_reserve_never_takes_every_slot_from_batch_work():
    assert [reserve_of(16, r) for r in (0, 1, 2, 15, 16, 40)] == [0, 1, 2, 15, 15, 15]
    assert reserve_of(8, 10) == 7
    assert reserve_of(1, 1) == 0  # a model of one slot keeps none back
    assert reserve_of(4, -3) == 0


def test_what_batch_work_leaves_the_calls():
    rule = {"limit": 16, "reserved": 2}
    # Nobody called lately: the reserve is lent, only waiting calls' claims hold slots.
    assert slots_withheld(**rule, calls_recent=False, calls_holding=0, calls_waiting=0) == 0
    assert slots_withheld(**rule, calls_recent=False, calls_holding=0, calls_waiting=3) == 3
    # Calls lately: the reserve, less what calls hold already.
    assert slots_withheld(**rule, calls_recent=True, calls_holding=0, calls_waiting=0) == 2
    assert slots_withheld(**rule, calls_recent=True, calls_holding=1, calls_waiting=0) == 1
    assert slots_withheld(**rule, calls_recent=True, calls_holding=5, calls_waiting=0) == 0
    # Waiting calls fill the reserve first: the larger of the two, not their sum.
    assert slots_withheld(**rule, calls_recent=True, calls_holding=0, calls_waiting=1) == 2
    assert slots_withheld(**rule, calls_recent=True, calls_holding=0, calls_waiting=4) == 4
    recent = {"calls_recent": True, "calls_holding": 0, "calls_waiting": 0}
    assert batch_may_take(limit=16, held=13, reserved=2, **recent)
    assert not batch_may_take(limit=16, held=14, reserved=2, **recent)
    assert batch_may_take(limit=16, held=15, reserved=2, **{**recent, "calls_recent": False})


# One event on a model: batch work asks for a slot, a call asks for one, one of either
# ends, or the calls stop (their mark and claims lapse).
events = st.lists(
    st.sampled_from(["batch", "batch", "batch", "call", "batch ends", "call ends", "quiet"]),
    max_size=120,
)


@given(limit=st.integers(1, 12), reserved=st.integers(0, 6), sequence=events)
def test_a_model_driven_by_the_rule_keeps_the_reserve_for_calls(limit, reserved, sequence):
    """Whatever the order: the slots are never overshot; while calls are recent, batch
    work grows only up to the limit less the reserve, so once what it took while the
    model was quiet has been given back, a call finds a free slot whenever calls hold
    fewer than the reserve; without calls, batch work may take every slot."""
    bulk = calls = waiting = 0
    recent = False
    lent = 0  # batch slots taken while nobody called, still held
    keep = reserve_of(limit, reserved)

    def batch_may() -> bool:
        return batch_may_take(
            limit=limit,
            held=bulk + calls,
            reserved=reserved,
            calls_recent=recent,
            calls_holding=calls,
            calls_waiting=waiting,
        )

    def free_slot() -> None:
        nonlocal calls, waiting
        if waiting:  # a waiting call claimed it
            calls, waiting = calls + 1, waiting - 1

    for event in sequence:
        if event == "quiet":
            recent, waiting = False, 0
        elif event == "batch" and batch_may():
            bulk += 1
            lent += 0 if recent else 1
        elif event == "call":
            recent = True
            if lent == 0 and calls < keep and waiting == 0:
                assert bulk + calls < limit  # the reserve is there for it
            if bulk + calls < limit:
                calls += 1
            else:
                waiting += 1  # it claims the next free slot
        elif event == "batch ends" and bulk:
            bulk, lent = bulk - 1, max(0, lent - 1)
            free_slot()
        elif event == "call ends" and calls:
            calls -= 1
            free_slot()
        assert 0 <= bulk + calls <= limit
        assert bulk - lent <= limit - keep  # what it took while calls were recent
        if not recent:  # nobody calls: every free slot is batch work's
            assert batch_may() == (bulk + calls < limit)
