"""Fair shares of a model's slots among tenants' synchronous calls (pure rules)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batchgen.domain.scheduling.call_shares import Demand, fair_shares, refuse_call, share_of
from batchgen.limits.call_demand import demand_entry, parse, tenant_key

demands = st.dictionaries(
    st.integers(1, 50),
    st.builds(
        Demand, weight=st.integers(1, 5), running=st.integers(0, 20), waiting=st.integers(0, 40)
    ),
    max_size=8,
)


@given(st.integers(1, 64), demands)
def test_shares_use_every_slot_asked_for_and_no_more(limit: int, asked: dict[int, Demand]):
    shares = fair_shares(limit, asked)
    total = sum(d.wanted for d in asked.values())
    askers = sum(1 for d in asked.values() if d.wanted > 0)
    assert set(shares) == set(asked)
    for key, demand in asked.items():
        assert shares[key] <= max(demand.wanted, 0)
        if demand.wanted > 0:
            assert shares[key] >= 1  # nobody waits forever
    if askers <= limit:
        assert sum(shares.values()) == min(limit, total)  # work-conserving


@given(st.integers(1, 64), demands)
def test_a_capped_tenant_has_no_less_per_weight_than_anyone_else(
    limit: int, asked: dict[int, Demand]
):
    """Max-min: a tenant that gets less than it asks for envies nobody by more than one
    slot (whole slots cannot split finer): another's last slot ranks, per weight, no
    later than this tenant's next one would. The one slot each is first is exempt."""
    shares = fair_shares(limit, asked)
    if sum(1 for d in asked.values() if d.wanted > 0) > limit:
        return
    for key, demand in asked.items():
        if shares[key] >= demand.wanted:
            continue
        for other, theirs in asked.items():
            if other != key and shares[other] > 1:
                assert shares[other] / theirs.weight <= (shares[key] + 1) / demand.weight


def test_a_flood_leaves_the_other_tenant_its_half():
    flood = Demand(weight=1, running=8, waiting=32)
    calm = Demand(weight=1, running=0, waiting=1)
    assert fair_shares(8, {1: flood, 2: calm}) == {1: 7, 2: 1}
    calm_many = Demand(weight=1, running=1, waiting=9)
    assert fair_shares(8, {1: flood, 2: calm_many}) == {1: 4, 2: 4}
    assert fair_shares(8, {1: flood}) == {1: 8}  # alone: every slot
    heavy = Demand(weight=3, running=0, waiting=20)
    assert fair_shares(8, {1: flood, 2: heavy}) == {1: 2, 2: 6}


def test_a_tenant_not_yet_counted_has_a_share_of_one():
    assert share_of(8, {1: Demand(1, 8, 30)}, 2) == 1


@given(
    st.integers(0, 100),
    st.integers(1, 16),
    st.floats(0, 30),
    st.floats(0, 120),
    st.floats(0.1, 600),
)
def test_refusals_name_who_fills_the_deadline(
    open_calls: int, share: int, call_s: float, model_wait_s: float, deadline_s: float
):
    refusal = refuse_call(
        open_calls=open_calls,
        share=share,
        call_s=call_s,
        model_wait_s=model_wait_s,
        deadline_s=deadline_s,
    )
    own_wait_s = (open_calls // share) * call_s
    if refusal is None:
        assert model_wait_s < deadline_s
        assert own_wait_s == 0 or own_wait_s + call_s < deadline_s
        return
    assert refusal.retry_after_s >= 1
    if refusal.status == 503:
        assert model_wait_s >= deadline_s
    else:
        assert refusal.status == 429 and own_wait_s + call_s >= deadline_s > 0


def test_a_tenant_within_its_share_is_never_refused_for_its_own_calls():
    """The calm tenant's call, with none of its own open, starts at once: taken."""
    assert refuse_call(open_calls=0, share=1, call_s=2.0, model_wait_s=0, deadline_s=10) is None
    flood = refuse_call(open_calls=40, share=4, call_s=2.0, model_wait_s=0, deadline_s=10)
    assert flood is not None and (flood.status, flood.retry_after_s) == (429, 20)


def test_demand_entries_parse_back_per_tenant():
    waiting = [demand_entry(1, 2, 10).encode(), demand_entry(1, 2, 11).encode(), b"junk"]
    running = [tenant_key(1, 2).encode(), tenant_key(3, 1), "x:y"]
    assert parse(waiting, running) == {1: Demand(2, 1, 2), 3: Demand(1, 1, 0)}


def test_a_ticket_carries_its_tenants_weight():
    from batchgen.store.items import Ticket

    ticket = Ticket(
        item_id=7,
        batch_id="batch_x",
        tenant_id=3,
        attempt=1,
        prompt_tokens_est=10,
        max_tokens=20,
        tenant_tokens_per_min=None,
        urgent=True,
        tenant_weight=4,
    )
    assert Ticket.from_message(7, ticket.to_message()) == ticket
    plain = Ticket.from_message(7, {**ticket.to_message(), "weight": 1})
    assert "weight" not in plain.to_message() and plain.tenant_weight == 1
