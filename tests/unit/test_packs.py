"""Packs: several items of a model in one message (sizing, splitting, running, the pace)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.config import Settings
from batchgen.domain.lifecycle.decisions import (
    pack_size,
    refill_at_once_after,
    split_into_packs,
    window_size,
)
from batchgen.worker.packs import (
    CallPace,
    PackItem,
    message_of,
    read_pack,
    run_pack,
)
from batchgen.worker.verdict import Verdict


def test_pack_size_follows_the_pace():
    assert pack_size(None, 0.05, 8) == 1  # no call seen yet: one item per message
    assert pack_size(0.2, 0.05, 8) == 1  # slow calls: one item, as before
    assert pack_size(0.05, 0.05, 8) == 1
    assert pack_size(0.02, 0.05, 8) == 2
    assert pack_size(0.01, 0.05, 8) == 5
    assert pack_size(0.001, 0.05, 8) == 8  # at most max_items
    assert pack_size(0.0, 0.05, 8) == 8
    assert pack_size(0.001, 0.05, 1) == 1  # packs off


@given(
    call_s=st.none() | st.floats(min_value=0, max_value=100, allow_nan=False),
    target_s=st.floats(min_value=0.001, max_value=10, allow_nan=False),
    max_items=st.integers(min_value=1, max_value=64),
)
def test_pack_size_is_within_bounds_and_holds_the_target(call_s, target_s, max_items):
    size = pack_size(call_s, target_s, max_items)
    assert 1 <= size <= max_items
    if size > 1 and call_s is not None:
        assert size * call_s <= target_s + 1e-9  # a pack's calls take about target_s


def test_the_window_grows_with_the_pack():
    assert window_size(16, 2.0, 1) == window_size(16, 2.0) == 32
    assert window_size(16, 2.0, 4) == 128  # the same 32 messages ahead, 4 items each
    assert window_size(3, 1.5, 2) == 10
    assert refill_at_once_after(32, 2.0, 1) == 16
    assert refill_at_once_after(32, 2.0, 8) == (512 - 32) // 2


def test_split_into_packs_keeps_the_order_and_sends_urgent_items_alone():
    items = list(range(10))
    assert split_into_packs(items, 4, alone=lambda i: False) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert split_into_packs(items, 4, alone=lambda i: i == 5) == [
        [0, 1, 2, 3],
        [4],
        [5],
        [6, 7, 8, 9],
    ]
    assert split_into_packs(items, 1, alone=lambda i: False) == [[i] for i in items]
    assert split_into_packs([], 4, alone=lambda i: False) == []


@given(
    items=st.lists(st.tuples(st.integers(), st.booleans()), max_size=60),
    size=st.integers(min_value=1, max_value=9),
)
def test_split_into_packs_loses_nothing(items, size):
    packs = split_into_packs(items, size, alone=lambda item: item[1])
    assert [item for pack in packs for item in pack] == items
    for pack in packs:
        assert 1 <= len(pack) <= size
        assert len(pack) == 1 or not any(urgent for _, urgent in pack)


def test_a_message_reads_back_as_its_pack():
    pack = [PackItem(7, {"attempt": 1}), PackItem(8, {"attempt": 2}), PackItem(9, None)]
    item_id, ticket, more = message_of(pack)
    assert (item_id, ticket) == (7, {"attempt": 1})
    assert read_pack(item_id, ticket, more) == pack
    assert message_of(pack[:1]) == (7, {"attempt": 1}, None)
    assert read_pack(7, None, None) == [PackItem(7, None)]  # an old message: one item


def test_unreadable_entries_of_a_message_are_left_to_the_sweep(caplog):
    pack = read_pack(1, None, [[2, {"a": 1}], "x", [3], ["four", None], [5, "ticket"], [6, None]])
    assert pack == [PackItem(1, None), PackItem(2, {"a": 1}), PackItem(6, None)]
    assert len([r for r in caplog.records if "left to the sweep" in r.message]) == 4
    assert read_pack(1, None, {"not": "a list"}) == [PackItem(1, None)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pack(n: int) -> list[PackItem]:
    return [PackItem(i, {"n": i}) for i in range(1, n + 1)]


def test_a_pack_runs_every_item_in_order():
    ran: list[int] = []

    def run_one(item: PackItem) -> Verdict:
        ran.append(item.item_id)
        return Verdict("succeeded", model="m", call_s=0.01)

    outcome = run_pack(_pack(4), run_one, max_s=1.0)
    assert ran == [1, 2, 3, 4]
    assert [v.outcome for v in outcome.verdicts] == ["succeeded"] * 4
    assert outcome.waiting == [] and outcome.handed_back == [] and outcome.countdown_s is None
    assert outcome.summary() == "succeeded 4"


def test_a_wait_holds_the_item_and_the_untried_rest():
    outcomes = iter(["succeeded", "wait"])

    def run_one(item: PackItem) -> Verdict:
        outcome = next(outcomes)
        return Verdict(outcome, 2.5 if outcome == "wait" else None, model="m")

    pack = _pack(5)
    result = run_pack(pack, run_one, max_s=1.0)
    assert [v.outcome for v in result.verdicts] == ["succeeded", "wait"]
    assert result.waiting == pack[1:]  # item 2 met the wait; 3-5 were not tried
    assert result.countdown_s == 2.5
    assert result.handed_back == []
    assert result.summary() == "succeeded 1, wait 1, waiting 3"


def test_a_pack_past_its_time_hands_the_rest_back():
    clock = FakeClock()

    def run_one(item: PackItem) -> Verdict:
        clock.now += 0.6  # each call takes 0.6 s
        return Verdict("succeeded", model="m")

    pack = _pack(5)
    result = run_pack(pack, run_one, max_s=1.0, clock=clock)
    assert len(result.verdicts) == 2  # 1.2 s after two: the rest go back
    assert result.handed_back == pack[2:]
    assert result.waiting == [] and result.countdown_s is None


def test_an_item_that_raises_ends_the_pack_and_hands_the_rest_back():
    def run_one(item: PackItem) -> Verdict:
        if item.item_id == 2:
            raise ConnectionError("database away")
        return Verdict("succeeded", model="m")

    pack = _pack(4)
    result = run_pack(pack, run_one, max_s=10.0)
    assert [v.outcome for v in result.verdicts] == ["succeeded"]
    assert isinstance(result.error, ConnectionError)
    assert result.handed_back == pack[2:]  # item 2's own delivery fails as it would alone
    assert result.waiting == []


def test_a_pack_item_knows_the_attempt_its_ticket_names():
    assert PackItem(1, {"attempt": 3}).attempt == 3
    assert PackItem(1, None).attempt is None
    assert PackItem(1, {"attempt": "3"}).attempt is None
    assert PackItem(1, {"attempt": True}).attempt is None


def test_the_first_item_always_runs():
    clock = FakeClock()
    clock.now = 100.0
    result = run_pack(_pack(1), lambda item: Verdict("expired"), max_s=0.0, clock=clock)
    assert [v.outcome for v in result.verdicts] == ["expired"]
    assert result.summary() == "expired"


def test_the_pace_is_a_low_quantile_of_recent_calls():
    pace = CallPace()
    assert pace.call_s("m") is None
    pace.note("m", 0.2)
    assert pace.call_s("m") == 0.2
    # Under load most calls wait for the process's CPU; the quick ones show the provider.
    for i in range(45):
        pace.note("m", 0.03 + i * 0.001)
    for _ in range(5):
        pace.note("m", 0.004)
    assert pace.call_s("m") == pytest.approx(0.004)
    assert pace.call_s("other") is None
    # Only the last SAMPLES count: slow answers replace the quick ones.
    for _ in range(CallPace.SAMPLES):
        pace.note("m", 1.5)
    assert pace.call_s("m") == 1.5


def test_the_pace_takes_notes_from_many_threads():
    pace = CallPace()
    threads = [
        threading.Thread(target=lambda: [pace.note("m", 0.01) for _ in range(200)])
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pace.call_s("m") == 0.01


def test_pack_settings_are_checked():
    assert Settings(pack_max_items=1).packs.max_items == 1
    with pytest.raises(ValueError):
        Settings(pack_max_items=0)
    with pytest.raises(ValueError):
        Settings(pack_target_s=0)
