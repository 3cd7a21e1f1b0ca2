"""The worker path's decisions, each made by the gate's Lua scripts on a real Redis
(one server for the session: :mod:`tests.fast.conftest`), in milliseconds.

Decisions covered, as :func:`batchgen.worker.execution._run_ticket` meets them:

- claim: a free slot and budget admit the call (``Pass``, reservation ``item:attempt``);
  a second delivery of the same attempt adopts that reservation and slot instead of
  taking more; every slot held is a short ``SLOT`` wait with its jitter.
- budget wait: a model over its tokens in the window is a firm ``TOKENS`` wait that
  says when capacity frees (with at most 10 % + 50 ms, ≤ 1 s, of jitter); the
  worker's plan for it (:func:`batchgen.domain.lifecycle.retry.plan_wait`) is a countdown retry
  when it fits the deadline and an expiry when it cannot; a tenant over its own
  ``tokens_per_min`` is a ``TENANT`` wait, deferred to give its dispatch place back;
  a request larger than the model's window is ``Never``.
- retry: a 429 settled on the gate closes the budget key for its retry-after (capped),
  so the next entry is a ``COOLDOWN`` wait, never an expiry of an item with time left.
- failover: across a model's deployments the gate takes the one with headroom, puts
  the deployment the item avoids (the one that failed it) last, and still takes it
  when it alone has room; a deployment whose circuit breaker tripped (server errors
  settled on it) is passed over while it cools down.
- settle: the answer's real usage replaces the reservation and frees the slot, once
  (a duplicate settle changes nothing); an entry that made no call gives all it took
  back, unless it adopted another delivery's reservation, which it leaves alone.

The same scripts meet real workers in ``tests/integration`` (test_budget, test_pools).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import redis

from batchgen.config import Settings
from batchgen.domain.lifecycle import retry
from batchgen.domain.scheduling.rate_limits import RateLimitState
from batchgen.errors import CallCancelled, RateLimited, TransientProviderError
from batchgen.limits import redis_keys as keys
from batchgen.limits.budget import jittered_s
from batchgen.limits.gate import SLOT_RETRY_S, Gate, Never, Pass, Wait, WaitKind
from batchgen.registry import ChargePolicy, ModelSpec
from tests.registries import model_spec, pool_spec

WINDOW_S = 10.0
# What the worker settles an entry with when nothing reached the provider
# (batchgen.worker.execution.NOT_SENT; that module's imports take seconds).
NOT_SENT = CallCancelled("not sent", billed=False)


@dataclass
class Ticket:
    """What the worker hands the gate for one attempt of one item."""

    item_id: int
    attempt: int = 1
    tenant_id: int = 1
    tenant_tokens_per_min: int | None = None
    prompt_tokens_est: int = 400
    max_tokens: int = 100
    avoid: str | None = None


@dataclass
class Answer:
    prompt_tokens: int = 410
    completion_tokens: int = 60
    rate_limits: RateLimitState = RateLimitState()


def spec(tpm: int = 100_000, slots: int = 4) -> ModelSpec:
    return model_spec(tpm=tpm, rpm=1000, slots=slots)


def pool(*deployments: tuple[str, int, int]) -> ModelSpec:
    """A model ``pool`` with deployments ``(name, tokens/min, slots)``."""
    return pool_spec(*((name, tpm, 1000, slots) for name, tpm, slots in deployments))


@pytest.fixture
def gate(fast_redis: redis.Redis) -> Gate:
    """The gate with no slot polling (a denied slot answers at once) and no slots kept
    for synchronous calls."""
    settings = Settings(
        budget_window_s=WINDOW_S, budget_guard_s=1.0, slot_wait_s=0.0, call_reserved_slots=0
    )
    return Gate(fast_redis, settings)


def max_jittered(wait_s: float) -> float:
    return jittered_s(wait_s, 1.0)


# --- claim --------------------------------------------------------------------------------


def test_a_free_slot_admits_the_call_and_a_second_delivery_adopts_it(gate: Gate) -> None:
    s = spec()
    first = gate.enter(s, Ticket(7, attempt=2))
    assert isinstance(first, Pass)
    assert first.reservation_id == "7:2" and first.deployment == s.deployments[0].name
    assert not first.adopted and not first.slot_adopted
    assert first.tokens >= 400 + 100  # the prompt (scaled) and the most it may answer

    again = gate.enter(s, Ticket(7, attempt=2))  # the same attempt, redelivered
    assert isinstance(again, Pass) and again.adopted and again.slot_adopted
    assert gate.client.zcard(keys.slots(s.name)) == 1  # one slot, not two
    assert gate.budget.used(s)[0] == first.tokens  # one reservation, not two


def test_every_slot_held_is_a_short_slot_wait_with_jitter(gate: Gate) -> None:
    s = spec(slots=2)
    assert isinstance(gate.enter(s, Ticket(1)), Pass)
    assert isinstance(gate.enter(s, Ticket(2)), Pass)
    waits = [gate.enter(s, Ticket(3)) for _ in range(20)]
    assert all(isinstance(w, Wait) and w.kind is WaitKind.SLOT for w in waits)
    seconds = [w.wait_s for w in waits if isinstance(w, Wait)]
    assert all(SLOT_RETRY_S <= w <= max_jittered(SLOT_RETRY_S) for w in seconds), seconds
    assert len(set(seconds)) > 1  # jittered: the denied do not all come back at once
    assert not WaitKind.SLOT.firm  # a slot may free sooner: never an early expiry


# --- budget wait --------------------------------------------------------------------------


def test_a_model_over_its_tokens_waits_firmly_for_the_window(gate: Gate) -> None:
    s = spec(tpm=1000)
    assert isinstance(gate.enter(s, Ticket(1, prompt_tokens_est=600)), Pass)
    denied = gate.enter(s, Ticket(2, prompt_tokens_est=600))
    assert isinstance(denied, Wait) and denied.kind is WaitKind.TOKENS and denied.kind.firm
    # The capacity frees when the first reservation leaves the window (and its guard).
    assert 0 < denied.wait_s <= max_jittered(WINDOW_S + 1.0), denied

    plan = retry.plan_wait(
        denied.wait_s, 3600, firm=True, releases_dispatch=False, max_countdown_s=60
    )
    assert plan == retry.WaitPlan(retry.WaitAction.REQUEUE, denied.wait_s)  # countdown
    late = retry.plan_wait(
        denied.wait_s, denied.wait_s, firm=True, releases_dispatch=False, max_countdown_s=60
    )
    assert late.action is retry.WaitAction.EXPIRE  # no call can fit before the deadline
    long = retry.plan_wait(
        denied.wait_s, 3600, firm=True, releases_dispatch=False, max_countdown_s=1
    )
    assert long == retry.WaitPlan(retry.WaitAction.DEFER, denied.wait_s)  # past a countdown


def test_a_tenant_over_its_own_budget_gives_its_dispatch_place_back(gate: Gate) -> None:
    s = spec()
    capped = dict(tenant_id=5, tenant_tokens_per_min=600)
    assert isinstance(gate.enter(s, Ticket(1, **capped)), Pass)  # type: ignore[arg-type]
    denied = gate.enter(s, Ticket(2, **capped))  # type: ignore[arg-type]
    assert isinstance(denied, Wait) and denied.kind is WaitKind.TENANT
    assert isinstance(gate.enter(s, Ticket(3, tenant_id=6)), Pass)  # others go on
    plan = retry.plan_wait(
        denied.wait_s,
        3600,
        firm=denied.kind.firm,
        releases_dispatch=denied.kind.releases_dispatch,
        max_countdown_s=60,
    )
    assert plan.action is retry.WaitAction.DEFER


def test_a_request_larger_than_the_window_never_fits(gate: Gate) -> None:
    s = spec(tpm=1000)
    assert isinstance(gate.enter(s, Ticket(1, prompt_tokens_est=5000)), Never)
    assert gate.client.zcard(keys.slots(s.name)) == 0  # and holds no slot


# --- retry after a 429 --------------------------------------------------------------------


def test_a_429_closes_the_budget_for_its_retry_after_and_expires_nothing(gate: Gate) -> None:
    s = spec()
    admitted = gate.enter(s, Ticket(1))
    assert isinstance(admitted, Pass)
    gate.settle(s, admitted, 1, 100, error=RateLimited("429", retry_after_s=4.0))
    assert gate.client.zcard(keys.slots(s.name)) == 0  # its slot is free

    denied = gate.enter(s, Ticket(2))
    assert isinstance(denied, Wait) and denied.kind is WaitKind.COOLDOWN
    assert 3.0 < denied.wait_s <= max_jittered(4.0), denied
    plan = retry.plan_wait(
        denied.wait_s,
        2.0,  # less time left than the cooldown: a probe at the deadline, not an expiry
        firm=denied.kind.firm,
        releases_dispatch=denied.kind.releases_dispatch,
        max_countdown_s=60,
    )
    assert plan == retry.WaitPlan(retry.WaitAction.REQUEUE, 2.0)


# --- failover between deployments ----------------------------------------------------------


def test_the_gate_takes_the_deployment_with_room_and_the_avoided_one_last(gate: Gate) -> None:
    s = pool(("a", 100_000, 1), ("b", 100_000, 1))
    first = gate.enter(s, Ticket(1, avoid="a"))
    assert isinstance(first, Pass) and first.deployment == "b"  # a failed it: b takes it
    second = gate.enter(s, Ticket(2, avoid="a"))
    assert isinstance(second, Pass) and second.deployment == "a"  # b is full: a after all
    third = gate.enter(s, Ticket(3))
    assert isinstance(third, Wait) and third.kind is WaitKind.SLOT  # both full

    gate.settle(s, first, 1, 100, response=Answer())  # b's slot frees...
    fourth = gate.enter(s, Ticket(4))
    assert isinstance(fourth, Pass) and fourth.deployment == "b"  # ...and b takes the next


def test_a_deployment_out_of_tokens_fails_the_call_over_to_the_other(gate: Gate) -> None:
    s = pool(("a", 1000, 8), ("b", 1000, 8))
    picks = [gate.enter(s, Ticket(n, prompt_tokens_est=600)) for n in range(3)]
    assert isinstance(picks[0], Pass) and isinstance(picks[1], Pass)
    assert {picks[0].deployment, picks[1].deployment} == {"a", "b"}  # one each
    assert isinstance(picks[2], Wait) and picks[2].kind is WaitKind.TOKENS  # no room left


def test_a_deployment_whose_breaker_tripped_is_passed_over_while_it_cools_down(
    gate: Gate,
) -> None:
    """Three server errors on ``a`` within the breaker's window (the default
    breaker_failures) trip it: the next calls go to ``b`` though ``a`` has more room."""
    s = pool(("a", 100_000, 8), ("b", 50_000, 8))
    for n in range(3):
        admitted = gate.enter(s, Ticket(n, avoid="b"))
        assert isinstance(admitted, Pass) and admitted.deployment == "a"
        gate.settle(s, admitted, 1, 100, error=TransientProviderError("500", status=500))
    picks = [gate.enter(s, Ticket(10 + n)) for n in range(4)]
    assert [p.deployment for p in picks if isinstance(p, Pass)] == ["b"] * 4


# --- settle -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "charged"),
    [(ChargePolicy.RESERVE, 410 + 100), (ChargePolicy.ACTUAL, 410 + 60)],
)
def test_the_answer_settles_the_reservation_to_its_usage_once(
    gate: Gate, policy: ChargePolicy, charged: int
) -> None:
    """The provider's prompt count, and its output as it counts it: max_tokens
    (OpenAI) or what it produced (Anthropic)."""
    s = spec().model_copy(update={"charge_policy": policy})
    admitted = gate.enter(s, Ticket(1, prompt_tokens_est=400, max_tokens=100))
    assert isinstance(admitted, Pass)
    assert gate.client.zcard(keys.slots(s.name)) == 1
    gate.settle(s, admitted, 1, 100, response=Answer(prompt_tokens=410, completion_tokens=60))
    assert gate.client.zcard(keys.slots(s.name)) == 0
    assert gate.budget.used(s) == (charged, 1)  # one request

    gate.settle(s, admitted, 1, 100, response=Answer(prompt_tokens=410, completion_tokens=60))
    assert gate.budget.used(s) == (charged, 1)  # a second settle changes nothing


def test_an_entry_that_made_no_call_gives_back_what_it_took_and_no_more(gate: Gate) -> None:
    s = spec()
    admitted = gate.enter(s, Ticket(1))
    assert isinstance(admitted, Pass)
    redelivered = gate.enter(s, Ticket(1))  # the same attempt, delivered again
    assert isinstance(redelivered, Pass) and redelivered.adopted
    gate.settle_unsent(s, redelivered, 1, 100, NOT_SENT)  # its claim found nothing
    assert gate.budget.used(s)[0] == admitted.tokens  # the first delivery's call is on
    assert gate.client.zcard(keys.slots(s.name)) == 1

    gate.settle_unsent(s, admitted, 1, 100, NOT_SENT)  # the first made no call either
    assert gate.budget.used(s)[0] == 0
    assert gate.client.zcard(keys.slots(s.name)) == 0
