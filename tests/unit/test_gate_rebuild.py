"""What is rebuilt of the gate's Redis state after Redis lost it (pure):
app/domain/scheduling/gate_rebuild.py."""

from __future__ import annotations

from batchgen.domain.scheduling.gate_rebuild import (
    Evidence,
    HeldSlot,
    RunningItem,
    SpentBudget,
    ended_slots,
    rebuild_plan,
)
from batchgen.registry import parse_registry
from tests.unit.test_pools import MODEL, ONE, POOL

POOLED = parse_registry(MODEL + POOL)
SINGLE = parse_registry(ONE)


def test_no_evidence_is_a_first_start_with_nothing_to_rebuild() -> None:
    plan = rebuild_plan(Evidence(), POOLED)
    assert plan.empty
    assert not Evidence().any


def test_a_billed_call_spends_its_deployments_budget_for_a_window() -> None:
    plan = rebuild_plan(Evidence(billed=[("m", "b")]), POOLED)
    b = POOLED["m"].deployment("b")
    assert plan.budgets == (SpentBudget("azure-east", 500, 5),)
    assert b.budget_key == "azure-east"
    assert plan.slots == ()


def test_a_deployment_not_known_spends_every_budget_of_its_model() -> None:
    plan = rebuild_plan(Evidence(billed=[("m", None)]), POOLED)
    assert {b.budget_key for b in plan.budgets} == {d.budget_key for d in POOLED["m"].deployments}


def test_running_items_retake_their_slots_and_spend_their_budget() -> None:
    running = [
        RunningItem(7, 2, "m", "b", 30.0),
        RunningItem(8, 1, "m", None, 12.5),
        RunningItem(9, 1, "m", "a", 0.0),  # its lease just ran out: no slot
    ]
    plan = rebuild_plan(Evidence(running=running), POOLED)
    own_b = POOLED["m"].deployment("b").slot_key
    assert set(plan.slots) == {
        HeldSlot("m", "7:2", 30.0),
        HeldSlot(own_b, "7:2", 30.0),
        HeldSlot("m", "8:1", 12.5),
    } - ({HeldSlot("m", "7:2", 30.0)} if own_b == "m" else set())
    assert {b.budget_key for b in plan.budgets} == {d.budget_key for d in POOLED["m"].deployments}


def test_single_deployment_model_and_unknown_models() -> None:
    evidence = Evidence(
        running=[RunningItem(1, 1, "m", "m", 5.0), RunningItem(2, 1, "gone", None, 5.0)],
        billed=[("m", "m"), ("gone", None)],
    )
    plan = rebuild_plan(evidence, SINGLE)
    assert plan.budgets == (SpentBudget("acct", 100, 1),)
    assert plan.slots == (HeldSlot("m", "1:1", 5.0),)


def test_slots_of_items_that_ended_during_the_rebuild_are_freed() -> None:
    """Read again after the rebuild: an item that ended (or runs a later attempt)
    frees the slot the rebuild gave it; one still running keeps it."""
    running = [RunningItem(7, 2, "m", "a", 30.0), RunningItem(8, 1, "m", "a", 30.0)]
    plan = rebuild_plan(Evidence(running=running), POOLED)
    again = Evidence(running=[RunningItem(8, 2, "m", "a", 30.0)])  # 7 ended, 8 retried
    assert {s.holder for s in ended_slots(plan, again)} == {"7:2", "8:1"}
    assert ended_slots(plan, Evidence(running=running)) == ()
