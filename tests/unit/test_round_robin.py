"""Deficit round robin (app/domain/scheduling/round_robin.py): properties of the dispatcher's fair
order across tenants, with the store's reads played by dictionaries."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.domain.scheduling.round_robin import (
    Member,
    Plan,
    Turn,
    interleave,
    jain_index,
    plan_round,
    ring_order,
    run_round,
)

weights = st.dictionaries(st.integers(1, 60), st.integers(1, 5), min_size=1, max_size=12)
round_sizes = st.lists(st.integers(0, 40), min_size=1, max_size=25)


def ring_from(tenants: Mapping[int, int], start: int, limit: int | None = None) -> list[Member]:
    ids = ring_order(tenants, start)
    return [Member(t, tenants[t]) for t in ids[: limit if limit is not None else len(ids)]]


def rounds(tenants: Mapping[int, int], sizes: list[int], *, whole: bool) -> tuple[list[int], Turn]:
    """Places given over rounds of ``sizes``, every tenant always having work; the ring
    is read whole, or only as far as a round can reach."""
    turn, given = Turn(), []
    for size in sizes:
        ring = ring_from(tenants, turn.start, None if whole else size)
        plan = plan_round(ring, turn, size, whole=whole or len(ring) < size)
        given.extend(plan.places)
        turn = plan.turn
    return given, turn


@given(weights, round_sizes)
def test_rounds_release_what_one_long_round_would(tenants, sizes):
    """The memory between rounds: splitting the places into rounds (of any sizes, the
    ring read whole or only as far as a round reaches) changes nothing."""
    one, _ = rounds(tenants, [sum(sizes)], whole=True)
    assert rounds(tenants, sizes, whole=True)[0] == one
    assert rounds(tenants, sizes, whole=False)[0] == one


@given(weights, round_sizes)
def test_releases_follow_the_weights_within_one_turn(tenants, sizes):
    given_places, _ = rounds(tenants, sizes, whole=False)
    served = Counter(given_places)
    per_weight = [served[t] / w for t, w in tenants.items()]
    # Each tenant has had the same number of turns, give or take the one under way.
    assert max(per_weight) - min(per_weight) <= 1.0
    if len(given_places) >= sum(tenants.values()):
        assert set(served) == set(tenants)  # a whole lap: every tenant served


@given(weights, st.integers(1, 200))
def test_every_place_is_given_and_only_to_tenants_in_the_ring(tenants, places):
    plan = plan_round(ring_from(tenants, 0), Turn(), places, whole=True)
    assert len(plan.places) == places
    assert set(plan.places) <= set(tenants)


def test_a_round_ending_mid_turn_carries_the_deficit():
    tenants = {1: 3, 2: 1}
    plan = plan_round(ring_from(tenants, 0), Turn(), 2, whole=True)
    assert plan.places == (1, 1) and plan.turn == Turn(1, 1)
    # The next round finishes tenant 1's turn before tenant 2's.
    again = plan_round(ring_from(tenants, plan.turn.start), plan.turn, 3, whole=True)
    assert again.places == (1, 2, 1)
    assert again.turn == Turn(1, 2)


def test_the_ring_starts_where_the_last_round_stopped_and_wraps():
    tenants = {10: 1, 20: 1, 30: 1}
    plan = plan_round(ring_from(tenants, 21), Turn(21, 0), 4, whole=True)
    assert plan.places == (30, 10, 20, 30)
    assert plan.turn == Turn(31, 0)


def test_a_turn_left_open_for_a_tenant_now_gone_is_not_carried_to_another():
    plan = plan_round(ring_from({5: 1, 9: 2}, 6), Turn(6, 4), 2, whole=True)
    assert plan.places == (9, 9)


def test_a_tenant_that_ran_dry_keeps_no_deficit():
    plan = Plan((4, 4, 4), Turn(4, 2))
    assert plan.short({4: 1}) == {4}
    assert plan.next_turn({4: 1}) == Turn(5, 0)
    assert plan.next_turn({4: 3}) == Turn(4, 2)


def test_a_partial_ring_too_short_for_the_places_is_refused():
    with pytest.raises(ValueError):
        plan_round([Member(1, 1)], Turn(), 2, whole=False)
    assert plan_round([], Turn(3, 1), 5, whole=True) == Plan((), Turn(3, 1))


def test_interleave_follows_the_places_and_each_tenants_order():
    picks = {1: ["a1", "a2"], 2: ["b1"]}
    assert interleave((1, 2, 1, 2, 1), picks) == ["a1", "b1", "a2"]


backlogs = st.dictionaries(
    st.integers(1, 40), st.tuples(st.integers(1, 4), st.integers(0, 30)), min_size=1, max_size=10
)


@given(backlogs, st.lists(st.integers(1, 30), min_size=1, max_size=15))
def test_a_round_fills_its_places_from_the_tenants_that_still_have_work(backlogs, sizes):
    """With finite backlogs (the store's reads played by a dictionary): no tenant gets
    more than it has, a round fills every place while any tenant has work, and the
    places of a tenant that ran dry go to the next ones."""
    left = {t: n for t, (_, n) in backlogs.items()}
    weight = {t: w for t, (w, _) in backlogs.items()}

    def read_ring(start: int, limit: int) -> tuple[list[Member], bool]:
        ready = ring_order([t for t, n in left.items() if n > 0], start)
        return [Member(t, weight[t]) for t in ready[:limit]], len(ready) <= limit

    def take(wanted: dict[int, int]) -> dict[int, list[tuple[int, int]]]:
        out = {}
        for tenant, n in wanted.items():
            got = min(n, left[tenant])
            left[tenant] -= got
            out[tenant] = [(tenant, k) for k in range(got)]
        return out

    turn = Turn()
    for size in sizes:
        before = sum(left.values())
        released, turn = run_round(read_ring, take, turn, size, max_passes=size + 1)
        assert len(released) == min(size, before)
        assert all(n >= 0 for n in left.values())


@given(backlogs, st.data(), st.lists(st.integers(1, 30), min_size=1, max_size=15))
def test_a_tenant_held_by_its_own_budget_leaves_its_places_to_the_others(backlogs, data, sizes):
    """Tenants held back by their own budget get no place while held, every place goes
    to the others while they have work, and once the holds end every tenant with work
    left is served within one lap of the ring (a held tenant is not starved)."""
    left = {t: n for t, (_, n) in backlogs.items()}
    weight = {t: w for t, (w, _) in backlogs.items()}
    held = data.draw(st.sets(st.sampled_from(sorted(backlogs))))

    def read_ring(start: int, limit: int) -> tuple[list[Member], bool]:
        ready = ring_order([t for t, n in left.items() if n > 0], start)
        return [Member(t, weight[t]) for t in ready[:limit]], len(ready) <= limit

    def take(wanted: dict[int, int]) -> dict[int, list[int]]:
        out = {}
        for tenant, n in wanted.items():
            got = min(n, left[tenant])
            left[tenant] -= got
            out[tenant] = [tenant] * got
        return out

    turn = Turn()
    for size in sizes:
        free_work = sum(n for t, n in left.items() if t not in held)
        released, turn = run_round(read_ring, take, turn, size, max_passes=size + 1, held=held)
        assert not set(released) & held
        assert len(released) == min(size, free_work)
    waiting = {t for t, n in left.items() if n > 0}
    served: set[int] = set()
    for _ in range(sum(weight.values())):  # one lap of the ring, one place a round
        released, turn = run_round(read_ring, take, turn, 1)
        served |= set(released)
    assert waiting <= served


def test_jain_index():
    assert jain_index([2, 2, 2]) == 1.0
    assert jain_index([1, 0, 0, 0]) == 0.25
    assert jain_index([]) == 1.0
