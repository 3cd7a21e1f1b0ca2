"""The worker's decisions as pure functions, and the item state moves the store
declares, checked against the one table of legal moves."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.domain.lifecycle.decisions import (
    AfterFailure,
    after_failure,
    attempt_cap,
    window_size,
)
from batchgen.domain.lifecycle.status import OPEN, TERMINAL, TRANSITIONS, ItemStatus, can_move
from batchgen.store import items


def _decide(**overrides):
    args = {
        "kind": "server_error",
        "message": "HTTP 500",
        "permanent": False,
        "attempt": 1,
        "max_attempts": 5,
        "retry_after_s": None,
        "time_left_s": 3600.0,
        "backoff_initial_s": 0.5,
        "backoff_max_s": 30.0,
        "rng": random.Random(7),
    }
    return after_failure(**{**args, **overrides})


def test_permanent_error_fails_at_once_whatever_the_attempts_left():
    decision = _decide(permanent=True, kind="invalid_request", message="bad")
    assert decision.action is AfterFailure.FAIL
    assert decision.code == "invalid_request"
    assert decision.message == "invalid_request: bad"


def test_last_attempt_fails_and_says_how_many():
    decision = _decide(attempt=5, max_attempts=5)
    assert decision.action is AfterFailure.FAIL
    assert decision.message.endswith("(after 5 attempts)")


def test_retry_honours_retry_after():
    decision = _decide(retry_after_s=8.0)
    assert decision.action is AfterFailure.RETRY
    assert 8.0 <= decision.wait_s <= 8.8


def test_a_retry_that_would_pass_the_deadline_expires():
    decision = _decide(retry_after_s=30.0, time_left_s=20.0)
    assert decision.action is AfterFailure.EXPIRE
    assert decision.code == "expired"
    assert "no time left to retry" in decision.message


@given(
    attempt=st.integers(1, 10),
    max_attempts=st.integers(1, 10),
    time_left_s=st.floats(0, 1000),
    seed=st.integers(0, 2**16),
)
def test_every_retry_fits_its_deadline_and_its_attempt_cap(
    attempt, max_attempts, time_left_s, seed
):
    decision = _decide(
        attempt=attempt, max_attempts=max_attempts, time_left_s=time_left_s, rng=random.Random(seed)
    )
    if decision.action is AfterFailure.RETRY:
        assert attempt < max_attempts
        assert decision.wait_s + 1.0 <= time_left_s
    if attempt >= max_attempts:
        assert decision.action is AfterFailure.FAIL


def test_window_and_attempt_caps():
    assert window_size(16, 2.0) == 32
    assert window_size(3, 1.5) == 5  # rounded up
    assert window_size(1, 0.1) == 1  # never closed
    assert attempt_cap(3, 5) == 3 and attempt_cap(9, 5) == 5


def test_every_declared_move_is_legal():
    for move in items.MOVES.values():
        for source in move.sources:
            for target in move.targets:
                assert can_move(source, target), (move.name, source, target)


def test_every_legal_transition_is_made_by_some_move():
    """No entry of the table is dead: each legal move is one the store makes."""
    made = {
        (source, target)
        for move in items.MOVES.values()
        for source in move.sources
        for target in move.targets
    }
    legal = {(source, target) for source, targets in TRANSITIONS.items() for target in targets}
    assert legal - made == set()


def test_an_illegal_move_is_refused_when_declared():
    with pytest.raises(AssertionError, match="illegal"):
        items._declare("bogus", {ItemStatus.SUCCEEDED}, {ItemStatus.RUNNING})
    assert "bogus" not in items.MOVES


def test_terminal_states_have_no_way_out_and_open_ones_a_way_to_end():
    assert all(not TRANSITIONS[s] for s in TERMINAL)
    assert all(TRANSITIONS[s] & TERMINAL for s in OPEN)


def test_finish_refuses_a_target_outside_its_move():
    with pytest.raises(ValueError, match="cannot end an item"):
        items.finish(None, None, ItemStatus.SUCCEEDED, "x", "y")  # type: ignore[arg-type]


def _rate_limit(**overrides):
    from batchgen.domain.lifecycle.decisions import after_rate_limit

    args = {
        "retry_after_s": 2.0,
        "rate_limited": 1,
        "max_rate_limited": 30,
        "time_left_s": 3600.0,
        "max_countdown_s": 60.0,
        "rng": random.Random(3),
    }
    return after_rate_limit(**{**args, **overrides})


def test_a_429_waits_its_retry_after_and_uses_no_attempt():
    from batchgen.domain.lifecycle.decisions import AfterRateLimit

    decision = _rate_limit(retry_after_s=2.0)
    assert decision.action is AfterRateLimit.REQUEUE
    assert 2.0 <= decision.wait_s <= 2.2


def test_a_long_429_wait_goes_back_to_postgres():
    from batchgen.domain.lifecycle.decisions import AfterRateLimit

    assert _rate_limit(retry_after_s=90.0).action is AfterRateLimit.DEFER


def test_the_429_cap_ends_the_item():
    from batchgen.domain.lifecycle.decisions import AfterRateLimit

    decision = _rate_limit(rate_limited=30, max_rate_limited=30)
    assert decision.action is AfterRateLimit.FAIL
    assert "30 times" in decision.message
    assert _rate_limit(rate_limited=29, max_rate_limited=30).action is not AfterRateLimit.FAIL


def test_a_429_never_expires_an_item_with_time_left():
    from batchgen.domain.lifecycle.decisions import AfterRateLimit

    decision = _rate_limit(retry_after_s=50.0, time_left_s=5.0)
    assert decision.action is AfterRateLimit.REQUEUE
    assert decision.wait_s <= 5.0  # comes back by its deadline at the latest
    assert _rate_limit(time_left_s=0.0).action is AfterRateLimit.EXPIRE


def test_a_group_of_slow_calls_overlaps_in_packs_of_a_quarter_of_the_slots():
    from batchgen.domain.lifecycle.decisions import together_pack_size

    # 200 ms calls, 64 slots: 8 items a message however slow, each call its own slot.
    assert together_pack_size(0.2, 0.05, 8, 64) == (8, True)
    assert together_pack_size(30.0, 0.05, 8, 64) == (8, True)
    assert together_pack_size(None, 0.05, 8, 64) == (8, True)  # no pace yet
    assert together_pack_size(0.2, 0.05, 32, 64) == (16, True)  # a quarter of the slots
    assert together_pack_size(0.2, 0.05, 8, 8) == (2, True)
    assert together_pack_size(0.2, 0.05, 8, 3) == (1, False)  # too few slots to share
    assert together_pack_size(0.2, 0.05, 1, 64) == (1, False)


def test_a_group_of_short_calls_runs_them_in_turn_when_as_many_fit():
    from batchgen.domain.lifecycle.decisions import together_pack_size

    assert together_pack_size(0.001, 0.05, 8, 64) == (8, False)  # 8 ms in all
    assert together_pack_size(0.01, 0.05, 8, 64) == (5, False)  # 5 fit in 50 ms
    assert together_pack_size(0.03, 0.05, 8, 64) == (8, True)  # only 1 fits: overlap


@given(
    call_s=st.one_of(st.none(), st.floats(min_value=0, max_value=600)),
    max_items=st.integers(min_value=1, max_value=64),
    cap=st.integers(min_value=1, max_value=1000),
)
def test_a_group_never_holds_more_slots_than_a_quarter_of_the_models(call_s, max_items, cap):
    from batchgen.domain.lifecycle.decisions import calls_overlap, together_pack_size

    items, overlap = together_pack_size(call_s, 0.05, max_items, cap)
    assert 1 <= items <= max_items
    if overlap:
        assert items <= max(1, cap // 4) and items > 1
    # The message's side decides the same way for the pack the refill made.
    assert calls_overlap(call_s, 0.05, items) == overlap


def test_a_group_of_short_calls_is_sized_by_count():
    from batchgen.domain.lifecycle.decisions import calls_overlap, round_size, together_pack_size

    # Zero-latency calls: as many as the count allows, run one after another.
    assert together_pack_size(0.001, 0.05, 8, 32, short_items=64, max_s=1.0) == (64, False)
    assert together_pack_size(0.0, 0.05, 8, 32, short_items=64, max_s=1.0) == (64, False)
    # 20 ms calls: as many as take half of max_s.
    assert together_pack_size(0.02, 0.05, 8, 32, short_items=64, max_s=1.0) == (25, False)
    # Not short (one fits in the target), or not known: overlapping, as before.
    assert together_pack_size(0.03, 0.05, 8, 64, short_items=64, max_s=1.0) == (8, True)
    assert together_pack_size(None, 0.05, 8, 64, short_items=64, max_s=1.0) == (8, True)
    # pack_max_items = 1 still turns packs off.
    assert together_pack_size(0.001, 0.05, 1, 64, short_items=64, max_s=1.0) == (1, False)
    # The worker that runs such a pack runs it in turn, in rounds of the old size.
    assert not calls_overlap(0.001, 0.05, 64)
    assert calls_overlap(None, 0.05, 64)
    # in rounds of a quarter of max_s at their pace, at most half of short_items
    assert round_size(0.001, 1.0, 8, 64) == 32
    assert round_size(0.01, 1.0, 8, 64) == 25
    assert round_size(0.1, 1.0, 8, 64) == 2
    assert round_size(None, 1.0, 8, 64) == 1
    assert round_size(0.001, 1.0, 8, 8) == 8  # never below max_items
    assert round_size(0.001, 1.0, 1, 64) == 1  # packs off


@given(
    call_s=st.one_of(st.none(), st.floats(min_value=0, max_value=600)),
    max_items=st.integers(min_value=1, max_value=64),
    short_items=st.integers(min_value=1, max_value=256),
    cap=st.integers(min_value=1, max_value=1000),
)
def test_a_pack_of_short_calls_fits_its_time(call_s, max_items, short_items, cap):
    from batchgen.domain.lifecycle.decisions import calls_overlap, together_pack_size

    items, overlap = together_pack_size(
        call_s, 0.05, max_items, cap, short_items=short_items, max_s=1.0
    )
    assert 1 <= items <= max(max_items, short_items)
    assert calls_overlap(call_s, 0.05, items) == overlap
    if not overlap and items > 2 and call_s is not None:
        assert call_s * items <= 0.5 + 1e-9  # half of max_s, one after another


def test_a_pack_of_short_calls_stops_its_rounds_only_when_its_calls_turn_slow():
    from batchgen.domain.lifecycle.decisions import rounds_stop

    # A busy process: the pack ran past max_s, but its calls are still short.
    assert not rounds_stop(0.002, 5.0, 0.05, 1.0, 120.0)
    # The calls turned slow (even the quickest), or none answered: after max_s.
    assert rounds_stop(0.2, 1.5, 0.05, 1.0, 120.0)
    assert rounds_stop(None, 1.5, 0.05, 1.0, 120.0)
    assert not rounds_stop(0.2, 0.5, 0.05, 1.0, 120.0)
    # Whatever the calls, before its untried items' queued leases could run out.
    assert rounds_stop(0.002, 60.0, 0.05, 1.0, 120.0)


def test_a_slow_pack_keeps_its_rest_while_every_slot_of_its_model_is_held():
    from batchgen.domain.lifecycle.decisions import room_for_overlap, rounds_stop

    asked: list[bool] = []

    def room(answer: bool):
        def ask() -> bool:
            asked.append(answer)
            return answer

        return ask

    # Slow calls past max_s: handed back only with room elsewhere.
    assert rounds_stop(0.2, 1.5, 0.05, 1.0, 120.0, room(True))
    assert not rounds_stop(0.2, 1.5, 0.05, 1.0, 120.0, room(False))
    # Asked only when the answer decides: not before max_s, not for short calls, not past
    # half the queued lease (handed back whatever the slots).
    assert not rounds_stop(0.2, 0.5, 0.05, 1.0, 120.0, room(True))
    assert not rounds_stop(0.002, 5.0, 0.05, 1.0, 120.0, room(True))
    assert rounds_stop(0.2, 60.0, 0.05, 1.0, 120.0, room(False))
    assert asked == [True, False]
    # Room: free slots for an overlapping pack (a quarter of the slots, at most
    # max_items, at least one).
    assert room_for_overlap(24, 32, 8) and not room_for_overlap(25, 32, 8)
    assert room_for_overlap(60, 64, 4) and not room_for_overlap(61, 64, 4)
    assert room_for_overlap(2, 3, 8) and not room_for_overlap(3, 3, 8)


def test_a_busy_host_keeps_a_slow_packs_rest_whatever_the_slots():
    from batchgen.domain.lifecycle.decisions import HOST_BUSY_SHARE, room_elsewhere

    asked: list[int] = []

    def held() -> int:
        asked.append(1)
        return 0  # every slot free

    # Calls of 60 ms (a pack's max_s of 1 s) on a host whose CPUs were all busy.
    assert not room_elsewhere(HOST_BUSY_SHARE, 0.06, 1.0, held, 32, 8)
    assert not room_elsewhere(1.0, 0.06, 1.0, held, 32, 8)
    assert asked == []  # the slots not asked
    # A host with CPU to spare, not known, a call of a quarter of max_s (the
    # provider's), or none answered: by the slots.
    assert room_elsewhere(HOST_BUSY_SHARE - 0.01, 0.06, 1.0, held, 32, 8)
    assert room_elsewhere(None, 0.06, 1.0, held, 32, 8)
    assert room_elsewhere(1.0, 0.25, 1.0, held, 32, 8)
    assert room_elsewhere(1.0, None, 1.0, held, 32, 8)
    assert not room_elsewhere(0.2, 0.06, 1.0, lambda: 30, 32, 8)
    assert asked == [1] * 4
