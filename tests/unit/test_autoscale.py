"""The autoscaling signal's maths (batchgen.domain.scheduling.autoscale): an idle model asks for
nothing, a budget-bound one for no more slots than its budget keeps busy."""

from __future__ import annotations

from dataclasses import replace

from batchgen.domain.scheduling.autoscale import (
    Demand,
    ModelLoad,
    budget_slots,
    demand,
    group_demand,
)

# 1 000 tokens a call, 60 000 tokens/min: 60 calls a minute; at 10 s a call, 10 slots.
BOUND = ModelLoad(
    ready_items=5000,
    running_calls=0,
    max_concurrency=200,
    tokens_per_min=60_000,
    requests_per_min=10_000,
    tokens_per_item=1000.0,
    budget_free_tokens=60_000.0,
    call_s=10.0,
)


def test_an_idle_model_asks_for_nothing() -> None:
    assert demand(replace(BOUND, ready_items=0)) == Demand(0, 0)


def test_a_budget_bound_model_asks_for_what_its_budget_keeps_busy() -> None:
    assert budget_slots(60_000, 10_000, 1000.0, 10.0) == 10
    assert demand(BOUND) == Demand(runnable_items=60, worker_slots=10)


def test_requests_per_min_bound_too() -> None:
    # 30 requests a minute at 10 s a call: 5 slots, whatever the tokens allow.
    assert demand(replace(BOUND, requests_per_min=30)).worker_slots == 5


def test_runnable_items_stop_at_free_slots_and_free_budget() -> None:
    assert demand(replace(BOUND, running_calls=195)).runnable_items == 5
    assert demand(replace(BOUND, budget_free_tokens=2500.0)).runnable_items == 2
    assert demand(replace(BOUND, budget_free_tokens=-10.0)).runnable_items == 0


def test_an_unbound_model_asks_for_its_work_up_to_its_concurrency() -> None:
    roomy = replace(BOUND, tokens_per_min=10**9)
    assert demand(replace(roomy, ready_items=7, running_calls=3)).worker_slots == 10
    assert demand(roomy).worker_slots == 200
    # No call time observed yet: no bound from the budget.
    assert demand(replace(BOUND, call_s=None)).worker_slots == 200


def test_running_calls_keep_their_slots_with_nothing_ready() -> None:
    assert demand(replace(BOUND, ready_items=0, running_calls=4)) == Demand(0, 4)


def test_a_group_sums_its_models() -> None:
    idle = replace(BOUND, ready_items=0)
    assert group_demand([BOUND, idle, BOUND]) == Demand(120, 20)
    assert group_demand([]) == Demand(0, 0)


def test_models_sharing_a_budget_ask_for_what_the_one_budget_keeps_busy() -> None:
    shared = replace(BOUND, budget_key="account")
    assert group_demand([shared, shared]) == Demand(60, 10)
    # Apart, each its own budget: twice as much.
    assert group_demand([shared, replace(BOUND, budget_key="other")]) == Demand(120, 20)
    # One of them idle: the other alone.
    assert group_demand([shared, replace(shared, ready_items=0)]) == Demand(60, 10)
