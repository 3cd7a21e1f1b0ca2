"""Settling a call's reservation: the pure decision, and the gate carrying it out (no servers)."""

from __future__ import annotations

import ast
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.domain.scheduling.rate_limits import RateLimitState
from batchgen.domain.scheduling.settlement import (
    DEFAULT_COOLDOWN_S,
    SettleAction,
    SettleCounter,
    Settlement,
    charged_tokens,
    decide_settlement,
)
from batchgen.errors import (
    CallCancelled,
    ContextLengthExceeded,
    MalformedResponse,
    PermanentProviderError,
    ProviderError,
    RateLimited,
    TransientProviderError,
)
from batchgen.registry import ChargePolicy, ModelSpec
from tests.registries import model_spec

ROOT = Path(__file__).resolve().parents[2]
RESERVE, ACTUAL = ChargePolicy.RESERVE, ChargePolicy.ACTUAL
C = SettleCounter


def spec(policy: ChargePolicy) -> ModelSpec:
    return model_spec(name="m", shape=None, charge_policy=policy)


def failed(error: ProviderError | None, policy: ChargePolicy = RESERVE) -> Settlement:
    return decide_settlement(charge_policy=policy, max_tokens=300, answered=False, error=error)


# --- an answer -------------------------------------------------------------------------


def test_charged_tokens_follow_the_charge_policy():
    assert charged_tokens(RESERVE, 100, 20, 300) == 400  # OpenAI keeps max_tokens charged
    assert charged_tokens(ACTUAL, 100, 20, 300) == 120  # Anthropic counts the real output


@pytest.mark.parametrize(("policy", "charged"), [(RESERVE, 400), (ACTUAL, 120)])
def test_an_answer_is_reconciled_to_what_was_charged_and_heard(policy, charged):
    decision = decide_settlement(
        charge_policy=policy, max_tokens=300, answered=True, prompt_tokens=100, completion_tokens=20
    )
    assert decision == Settlement(
        SettleAction.RECONCILE, charged_tokens=charged, observe_rate_limits=True
    )


def test_an_answer_wins_over_an_error():
    decision = decide_settlement(
        charge_policy=ACTUAL,
        max_tokens=300,
        answered=True,
        prompt_tokens=7,
        completion_tokens=3,
        error=RateLimited("429", retry_after_s=5),
    )
    assert decision.action is SettleAction.RECONCILE and decision.charged_tokens == 10
    assert decision.cooldown_s is None and decision.counters == ()


# --- a failure: released, kept, cooled down, counted -------------------------------------


def test_a_429_releases_cools_down_and_counts():
    assert failed(RateLimited("429", retry_after_s=3600)) == Settlement(
        SettleAction.RELEASE, cooldown_s=3600, counters=(C.COOLDOWNS, C.RATE_LIMITED)
    )  # the cap on the cooldown is the budget's (Budget.cool_down)


def test_a_429_with_rate_limit_headers_is_heard():
    headers = RateLimitState(remaining_tokens=0, reset_tokens_s=3.0)
    assert failed(RateLimited("429", retry_after_s=2, rate_limits=headers)) == Settlement(
        SettleAction.RELEASE,
        observe_rate_limits=True,
        cooldown_s=2,
        counters=(C.COOLDOWNS, C.RATE_LIMITED),
    )


@pytest.mark.parametrize("retry_after_s", [None, 0.0])
def test_a_429_without_a_usable_retry_after_cools_down_for_the_default(retry_after_s):
    decision = failed(RateLimited("429", retry_after_s=retry_after_s))
    assert decision.cooldown_s == DEFAULT_COOLDOWN_S == 1.0
    assert decision.action is SettleAction.RELEASE


def test_a_429_without_a_status_is_still_a_429_not_a_connect_failure():
    decision = failed(RateLimited("429", status=None, retry_after_s=2.5))
    assert decision.counters == (C.COOLDOWNS, C.RATE_LIMITED) and decision.cooldown_s == 2.5


def test_a_call_cancelled_before_it_was_sent_is_released_uncounted():
    assert failed(CallCancelled("cancelled", billed=False)) == Settlement(SettleAction.RELEASE)


def test_a_call_cancelled_mid_answer_keeps_its_reservation_uncounted():
    assert failed(CallCancelled("cancelled", billed=True)) == Settlement(SettleAction.KEEP)
    assert failed(CallCancelled("cancelled", status=200)) == Settlement(SettleAction.KEEP)


@pytest.mark.parametrize(
    "error",
    [
        PermanentProviderError("bad request", status=400),
        PermanentProviderError("rejected", status=None, billed=True),
        ContextLengthExceeded("too long", status=400),
    ],
)
def test_a_permanent_error_is_released_and_counted(error):
    assert failed(error) == Settlement(SettleAction.RELEASE, counters=(C.PERMANENT_ERRORS,))


@pytest.mark.parametrize(
    "error",
    [
        TransientProviderError("connect refused"),
        MalformedResponse("no body"),
        ProviderError("could not connect"),
    ],
)
def test_a_connect_failure_is_released_and_counted_as_transient(error):
    assert failed(error) == Settlement(SettleAction.RELEASE, counters=(C.TRANSIENT_ERRORS,))


@pytest.mark.parametrize(
    "error",
    [
        TransientProviderError("server error", status=503),
        TransientProviderError("read timeout", billed=True),  # sent: it may have counted
        MalformedResponse("truncated", status=200),
        ProviderError("odd", status=500),
        None,  # neither an answer nor an error: settled as a transient failure
    ],
)
def test_a_transient_error_after_sending_keeps_the_reservation(error):
    assert failed(error) == Settlement(SettleAction.KEEP, counters=(C.TRANSIENT_ERRORS,))


def test_the_policy_only_matters_for_an_answer():
    for error in (RateLimited("429", retry_after_s=1), PermanentProviderError("x", status=400)):
        assert failed(error, RESERVE) == failed(error, ACTUAL)


def test_a_settlement_is_frozen():
    decision = failed(None)
    with pytest.raises(FrozenInstanceError):
        decision.action = SettleAction.RELEASE  # type: ignore[misc]


# --- every case at once --------------------------------------------------------------------

errors = st.one_of(
    st.none(),
    st.builds(
        RateLimited,
        st.just("429"),
        status=st.sampled_from([None, 429]),
        retry_after_s=st.none() | st.floats(0, 7200),
        rate_limits=st.none() | st.builds(RateLimitState, remaining_tokens=st.integers(0, 10)),
    ),
    st.builds(CallCancelled, st.just("c"), billed=st.booleans()),
    *(
        st.builds(cls, st.just("e"), status=st.sampled_from([None, 400, 500]), billed=st.booleans())
        for cls in (
            ProviderError,
            TransientProviderError,
            MalformedResponse,
            PermanentProviderError,
            ContextLengthExceeded,
        )
    ),
)


@given(
    policy=st.sampled_from(list(ChargePolicy)),
    max_tokens=st.integers(0, 100_000),
    answered=st.booleans(),
    prompt=st.integers(0, 100_000),
    completion=st.integers(0, 100_000),
    error=errors,
)
def test_the_decision_is_consistent(policy, max_tokens, answered, prompt, completion, error):
    d = decide_settlement(
        charge_policy=policy,
        max_tokens=max_tokens,
        answered=answered,
        prompt_tokens=prompt,
        completion_tokens=completion,
        error=error,
    )
    assert (d.action is SettleAction.RECONCILE) == answered
    assert (d.charged_tokens is not None) == answered
    # Headers are heard on an answer, and on a 429 that carried them.
    heard_429 = isinstance(error, RateLimited) and error.rate_limits is not None
    assert d.observe_rate_limits == (answered or heard_429)
    if answered:
        assert d.charged_tokens == charged_tokens(policy, prompt, completion, max_tokens)
        assert d.cooldown_s is None and d.counters == ()
        return
    rate_limited = isinstance(error, RateLimited)
    assert (d.cooldown_s is not None) == rate_limited == (C.COOLDOWNS in d.counters)
    if d.cooldown_s is not None:
        assert d.cooldown_s > 0
    assert len(d.counters) == len(set(d.counters)) <= 2
    # Kept only when the provider may have counted the call.
    if d.action is SettleAction.KEEP:
        assert error is None or error.billed or error.status is not None
        assert not isinstance(error, RateLimited | PermanentProviderError)
    # An error is counted unless it is a cancellation.
    assert bool(d.counters) == (not isinstance(error, CallCancelled))


# --- the module stays pure -----------------------------------------------------------------


def test_the_settlement_module_imports_only_domain_config_errors_registry():
    tree = ast.parse((ROOT / "app" / "domain" / "scheduling" / "settlement.py").read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    allowed = ("batchgen.config", "batchgen.errors", "batchgen.registry", "batchgen.domain")
    ours = {m for m in modules if m == "batchgen" or m.startswith("batchgen.")}
    assert (
        ours
        and {m for m in ours if not any(m == a or m.startswith(a + ".") for a in allowed)} == set()
    )


# --- the gate carries the decision out, in one script ---------------------------------------


class FakeBudget:
    def __init__(self, calls: list[tuple]):
        self.calls = calls

    def settle(self, spec, rid, ops):
        self.calls.append(("settle", rid, ops))


class FakeSlots:
    def __init__(self, calls: list[tuple]):
        self.calls = calls

    def release(self, model, holder):
        self.calls.append(("slot_release", holder))


HEADERS = RateLimitState(remaining_tokens=500, remaining_requests=3, reset_tokens_s=2.0)


class Answer:
    prompt_tokens = 100
    completion_tokens = 20
    rate_limits = HEADERS


class EstimatedAnswer(Answer):
    usage_estimated = True  # no usage reported: our own counts, nothing to learn from


def gate_calls(policy: ChargePolicy = RESERVE, *, enabled: bool = True, **outcome) -> list[tuple]:
    from batchgen.limits.gate import Gate, Pass

    calls: list[tuple] = []
    gate = Gate.__new__(Gate)
    gate.budget = FakeBudget(calls)  # type: ignore[assignment]
    gate.slots = FakeSlots(calls)  # type: ignore[assignment]
    gate.enabled = enabled
    gate.settle(spec(policy), Pass("7:1", 400, prompt_tokens_est=90), 3, 300, **outcome)
    return calls


def ops(action: str = "", **fields):
    from batchgen.limits.budget import SettleOps

    return SettleOps(action, tenant_id=3, release_slot=True, **fields)


def test_the_gate_reconciles_hears_the_headers_and_frees_the_slot_in_one_call():
    assert gate_calls(ACTUAL, response=Answer()) == [
        (
            "settle",
            "7:1",
            ops(
                "reconcile",
                charged_tokens=120,
                charged_rest=20,  # the output: a bucket adds it to the prompt as reserved
                rate_limits=HEADERS,
                usage_prompt_tokens=100,  # the provider's count of the prompt ...
                prompt_tokens_est=90,  # ... and ours, for the ratio
            ),
        )
    ]
    [(_, _, reserve)] = gate_calls(RESERVE, response=EstimatedAnswer())
    assert (reserve.charged_tokens, reserve.charged_rest) == (400, 300)
    assert reserve.usage_prompt_tokens is None and reserve.prompt_tokens_est is None


def test_the_gate_releases_cools_down_and_counts_after_a_429():
    assert gate_calls(error=RateLimited("429", retry_after_s=None)) == [
        (
            "settle",
            "7:1",
            ops("release", cooldown_s=DEFAULT_COOLDOWN_S, counters=("cooldowns", "rate_limited")),
        )
    ]


def test_the_gate_hears_the_headers_of_a_429():
    error = RateLimited("429", retry_after_s=2.0, rate_limits=HEADERS)
    [(_, _, heard)] = gate_calls(error=error)
    assert heard.action == "release" and heard.rate_limits == HEADERS
    assert heard.cooldown_s == 2.0 and heard.usage_prompt_tokens is None


def test_the_gate_keeps_a_reservation_the_provider_may_have_counted():
    assert gate_calls(error=TransientProviderError("503", status=503)) == [
        ("settle", "7:1", ops(counters=("transient_errors",)))
    ]
    assert gate_calls(error=CallCancelled("c", billed=True)) == [("settle", "7:1", ops())]
    assert gate_calls(error=PermanentProviderError("400", status=400)) == [
        ("settle", "7:1", ops("release", counters=("permanent_errors",)))
    ]


def test_the_gate_frees_the_slot_even_when_redis_fails():
    import redis

    class Broken(FakeBudget):
        def settle(self, spec, rid, ops):
            raise redis.ConnectionError("down")

    from batchgen.limits.gate import Gate, Pass

    calls: list[tuple] = []
    gate = Gate.__new__(Gate)
    gate.budget = Broken(calls)  # type: ignore[assignment]
    gate.slots = FakeSlots(calls)  # type: ignore[assignment]
    gate.enabled = True
    with pytest.raises(redis.ConnectionError):
        gate.settle(spec(RESERVE), Pass("7:1", 400), 3, 300, error=CallCancelled("c", billed=False))
    assert calls == [("slot_release", "7:1")]


def test_a_disabled_gate_settles_nothing():
    assert gate_calls(enabled=False, response=Answer()) == []


def test_every_settlement_counter_is_a_counter_field():
    from batchgen.limits import counters
    from batchgen.limits.gate import _SETTLE_COUNTERS

    assert set(_SETTLE_COUNTERS) == set(SettleCounter)
    for counter, field in _SETTLE_COUNTERS.items():
        assert field == counter.value
        assert field in vars(counters).values()
