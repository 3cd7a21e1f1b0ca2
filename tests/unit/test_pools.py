"""Deployment pools without servers: the registry's deployments, the pure choices
(which deployment, failover, breaker timing), a failed-over item in a pack, and the
simulator's deployment lanes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.domain.scheduling.pools import (
    Room,
    breaker_cooldown_s,
    breaker_signal,
    breaker_trips,
    failover_reason,
    fails_over,
    headroom,
    pick,
)
from batchgen.errors import (
    CallCancelled,
    ConfigError,
    ContextLengthExceeded,
    MalformedResponse,
    PermanentProviderError,
    RateLimited,
    TransientProviderError,
    Unsendable,
)
from batchgen.registry import ProviderKind, parse_registry
from batchgen.simulator.lanes import Lane, LaneConfig
from batchgen.store.items import Ticket
from batchgen.worker.packs import PackItem, run_pack
from batchgen.worker.verdict import Verdict

MODEL = """
[models."m"]
provider = "openai"
base_url = "http://x/v1"
api_key_env = "K"
group = "g"
context_window = 1000
max_output_tokens = 100
input_usd_per_1m = 1
output_usd_per_1m = 2
"""
POOL = """
[models."m".deployments.a]
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 2

[models."m".deployments.b]
provider = "azure"
base_url = "https://east.openai.azure.com"
api_key_env = "AZ_KEY"
azure_deployment = "gpt-east"
api_version = "2024-10-21"
region = "eastus"
budget_key = "azure-east"
tokens_per_min = 500
requests_per_min = 5
max_concurrency = 1
limit_shape = "bucket"
output_usd_per_1m = 3
[models."m".deployments.b.tiers.batch]
multiplier = 0.4
"""
LIMITS = "tokens_per_min = 100\nrequests_per_min = 1\nmax_concurrency = 1\n"
ONE = MODEL + 'budget_key = "acct"\n' + LIMITS


# --- the registry ------------------------------------------------------------------


def test_a_model_without_deployments_is_its_one_deployment_as_before():
    spec = parse_registry(ONE)["m"]
    (d,) = spec.deployments
    assert (d.name, d.budget_key, d.slot_key) == ("default", "acct", "m")
    assert (d.tokens_per_min, d.base_url, d.api_key_env) == (100, "http://x/v1", "K")
    assert not spec.pooled and spec.at(None) is spec and spec.served_by == "default"


def test_deployments_inherit_the_models_endpoint_and_sum_their_limits():
    spec = parse_registry(MODEL + POOL)["m"]
    a, b = spec.deployments
    assert spec.pooled and spec.served_by is None
    assert (spec.tokens_per_min, spec.requests_per_min, spec.max_concurrency) == (1500, 15, 3)
    assert (a.provider, a.base_url, a.api_key_env) == (ProviderKind.OPENAI, "http://x/v1", "K")
    assert (a.budget_key, a.slot_key, b.budget_key, b.slot_key) == (
        "m:a",
        "m@a",
        "azure-east",
        "m@b",
    )
    assert (b.provider, b.azure_deployment, b.api_version, b.region) == (
        ProviderKind.AZURE,
        "gpt-east",
        "2024-10-21",
        "eastus",
    )


def test_a_call_view_takes_the_deployments_endpoint_limits_and_prices():
    spec = parse_registry(MODEL + POOL)["m"]
    b = spec.at("b")
    assert (b.provider, b.base_url, b.api_key_env, b.azure_deployment) == (
        ProviderKind.AZURE,
        "https://east.openai.azure.com",
        "AZ_KEY",
        "gpt-east",
    )
    assert (b.budget_key, b.tokens_per_min, b.max_concurrency, b.limit_shape.value) == (
        "azure-east",
        500,
        1,
        "bucket",
    )
    assert (b.name, b.served_by, b.input_usd_per_1m, b.output_usd_per_1m) == ("m", "b", 1, 3)
    assert b.tiers[next(iter(b.tiers))].multiplier == 0.4
    a = spec.at("a")
    assert (a.output_usd_per_1m, a.tiers) == (2, {})  # the model's own prices


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (MODEL + LIMITS + POOL, "with deployments, set limits on each deployment"),
        (MODEL + '[models."m".deployments.a]\ntokens_per_min = 5\n', "deployment 'a' needs"),
        (MODEL + '[models."m".deployments."a b"]\n' + LIMITS, "deployments.0.name"),
        (
            MODEL + '[models."m".deployments.a]\nprovider = "azure"\n' + LIMITS,
            "provider azure needs api_version",
        ),
        (ONE.replace('"openai"', '"azure"'), "provider azure needs api_version"),
        (MODEL + '[models."m".deployments.a]\nkey = "sk-123"\n' + LIMITS, "key"),
    ],
)
def test_bad_deployments_are_refused_naming_what_is_wrong(toml, message):
    with pytest.raises(ConfigError, match="model 'm'") as raised:
        parse_registry(toml, "models.toml")
    assert message in str(raised.value)


def test_deployments_sharing_an_account_must_share_its_limits():
    other = MODEL.replace('"m"', '"n"') + LIMITS.replace("100", "200") + 'budget_key = "m:a"\n'
    with pytest.raises(ConfigError, match="budget_key 'm:a'.*'m@a': 1000.*'n': 200"):
        parse_registry(MODEL + POOL + other)


# --- the pure choices --------------------------------------------------------------


def room(free: float, limit: int = 1000, **kw) -> Room:
    return Room(True, free, limit, kw.pop("free_requests", 9), 10, **kw)


def test_headroom_is_the_smallest_share_left():
    assert headroom(Room(True, 500, 1000, 9, 10)) == 0.5
    assert headroom(Room(True, 900, 1000, 2, 10)) == 0.2
    assert headroom(Room(True, 900, 1000, 9, 10, free_slots=0, slot_limit=4)) == 0.0


def test_pick_prefers_the_unavoided_then_the_most_headroom_then_the_first():
    assert pick([room(100), room(600), room(300)]) == 1
    assert pick([room(600), room(600)]) == 0
    assert pick([room(900, avoided=True), room(100)]) == 1
    assert pick([room(900, avoided=True), Room(False)]) == 0
    assert pick([Room(False), Room(False)]) is None
    # The same share of a smaller deployment is as good as of a bigger one.
    assert pick([room(100, limit=1000), room(60, limit=200)]) == 1


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 1000), st.booleans()), max_size=6))
def test_pick_never_takes_one_that_does_not_fit_nor_an_avoided_one_needlessly(rooms):
    choices = [Room(fits, free, 1000, 9, 10, avoided=av) for fits, free, av in rooms]
    chosen = pick(choices)
    if chosen is None:
        assert not any(r.fits for r in choices)
        return
    assert choices[chosen].fits
    if choices[chosen].avoided:
        assert all(r.avoided for r in choices if r.fits)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (RateLimited("429", retry_after_s=1), "rate_limited"),
        (TransientProviderError("HTTP 503", status=503), "server_error"),
        (TransientProviderError("HTTP 529", status=529), "server_error"),
        (TransientProviderError("timeout (ReadTimeout)", billed=True), "timeout"),
        (TransientProviderError("HTTP 408", status=408), "connection"),
        (TransientProviderError("connection error (ConnectError)"), "connection"),
        (TransientProviderError("timeout (stream deadline)", status=200, billed=True), "timeout"),
        (TransientProviderError("HTTP 409", status=409), None),
        (MalformedResponse("malformed", billed=True), None),
        (PermanentProviderError("HTTP 401", status=401), None),
        (ContextLengthExceeded("too long", status=400), None),
        (CallCancelled("cancelled"), None),
        (Unsendable("request not sendable (LocalProtocolError)"), "unsendable"),
    ],
)
def test_failover_reason_blames_the_deployment_only_for_its_own_failures(error, reason):
    assert failover_reason(error) == reason


def test_an_item_fails_over_only_in_a_pool_for_the_deployments_failure_in_time():
    base = {"deployments": 3, "reason": "server_error", "failovers": 2, "max_failovers": 20}
    assert fails_over(**base, time_left_s=30)
    assert not fails_over(**{**base, "deployments": 1}, time_left_s=30)
    assert not fails_over(**{**base, "reason": None}, time_left_s=30)
    assert not fails_over(**{**base, "failovers": 20}, time_left_s=30)
    assert not fails_over(**base, time_left_s=0)


def test_the_breaker_trips_at_its_threshold_or_on_a_failed_probe():
    assert not breaker_trips(2, 3, tripped_before=False)
    assert breaker_trips(3, 3, tripped_before=False)
    assert breaker_trips(1, 3, tripped_before=True)


def test_the_breakers_cooldown_doubles_up_to_the_cap():
    assert [breaker_cooldown_s(t, 5, 60) for t in range(1, 7)] == [5, 10, 20, 40, 60, 60]


def test_what_a_calls_end_tells_the_breaker():
    server = TransientProviderError("HTTP 500", status=500)
    assert breaker_signal(deployments=1, answered=True, error=None) == ""
    assert breaker_signal(deployments=2, answered=True, error=None) == "ok"
    assert breaker_signal(deployments=2, answered=False, error=server) == "fail"
    assert (
        breaker_signal(deployments=2, answered=False, error=RateLimited("", retry_after_s=1)) == ""
    )
    assert breaker_signal(deployments=2, answered=False, error=CallCancelled("c")) == ""


def test_a_time_out_cut_short_by_the_items_deadline_tells_the_breaker_nothing():
    """The call's time-out was its item's time left: its time-out is the item's, while
    a 5xx in the same short time is still the deployment's."""
    timeout = TransientProviderError("timeout (ReadTimeout)", billed=True)
    stream = TransientProviderError("timeout (stream deadline)", status=200, billed=True)
    server = TransientProviderError("HTTP 503", status=503)
    for error in (timeout, stream):
        assert breaker_signal(deployments=2, answered=False, error=error) == "fail"
        signal = breaker_signal(deployments=2, answered=False, error=error, cut_by_deadline=True)
        assert signal == ""
    assert (
        breaker_signal(deployments=2, answered=False, error=server, cut_by_deadline=True) == "fail"
    )


# --- the worker's side -------------------------------------------------------------


def ticket(item_id: int = 1, attempt: int = 1, avoid: str | None = None) -> Ticket:
    return Ticket(
        item_id=item_id,
        batch_id="b",
        tenant_id=1,
        attempt=attempt,
        prompt_tokens_est=10,
        max_tokens=20,
        tenant_tokens_per_min=None,
        avoid=avoid,
    )


def test_the_deployment_to_avoid_travels_in_the_ticket():
    message = ticket(avoid="east").to_message()
    assert message["avoid"] == "east"
    assert Ticket.from_message(1, message) == ticket(avoid="east")
    assert "avoid" not in ticket().to_message()


def test_a_failed_over_item_is_handed_on_at_once_and_the_pack_runs_on():
    pack = [PackItem(i, ticket(i).to_message()) for i in (1, 2, 3)]
    moved = Verdict("wait", 0.0, ticket=ticket(2, attempt=2, avoid="a"))
    verdicts = {1: Verdict("succeeded"), 2: moved, 3: Verdict("succeeded")}
    outcome = run_pack(pack, lambda item: verdicts[item.item_id], max_s=60)
    assert [v.outcome for v in outcome.verdicts] == ["succeeded", "wait", "succeeded"]
    assert outcome.waiting == [] and outcome.error is None
    (handed,) = outcome.handed_back
    assert (handed.item_id, handed.attempt, handed.ticket["avoid"]) == (2, 2, "a")
    # Last in its pack: it is the message's own retry, with its new ticket.
    outcome = run_pack(pack[:2], lambda item: verdicts[item.item_id], max_s=60)
    assert outcome.countdown_s == 0.0 and outcome.handed_back == []
    assert [(p.item_id, p.attempt) for p in outcome.waiting] == [(2, 2)]


# --- the simulator's deployments -----------------------------------------------------


def test_a_simulated_deployment_is_parsed_and_checked():
    name, config = LaneConfig.parse("east:tpm=3000,rpm=50,fault_rate=0.5,fault_kinds=5xx+hang")
    assert (name, config.tokens_per_min, config.requests_per_min) == ("east", 3000, 50)
    assert (config.fault_rate, config.fault_kinds, config.fault_for_s) == (
        0.5,
        ("5xx", "hang"),
        None,
    )
    for bad in ("east:tpm=0", "east:fault_rate=2", "east:limiter=leaky", "east:nope=1", ":tpm=1"):
        with pytest.raises(ValueError):
            LaneConfig.parse(bad)


def test_a_simulated_deployments_faults_end_with_its_fault_time():
    failing = Lane.of("c", LaneConfig(fault_rate=1.0, fault_for_s=60), 60.0, seed=1)
    assert failing.fault(None) == "5xx"
    assert failing.fault("none") is None  # the header still wins
    ended = Lane.of("c", LaneConfig(fault_rate=1.0, fault_for_s=0), 60.0, seed=1)
    assert ended.fault(None) is None
    assert ended.fault("hang") == "hang"


def test_without_a_budget_the_gate_takes_the_first_deployment_not_avoided():
    import redis

    from batchgen.config import Settings
    from batchgen.limits.gate import Gate, Pass

    gate = Gate(redis.Redis(), Settings(budget_enabled=False))
    spec = parse_registry(MODEL + POOL)["m"]
    first = gate.enter(spec, ticket())
    avoided = gate.enter(spec, ticket(avoid="a"))
    assert isinstance(first, Pass) and isinstance(avoided, Pass)
    assert (first.deployment, avoided.deployment) == ("a", "b")


def test_every_deployment_is_warmed_before_a_call_enters_the_gate(monkeypatch):
    """``warm_model`` builds each deployment's client once (the worker calls it before
    the gate, so a first call's SDK imports never follow the budget's yes)."""
    from batchgen import providers

    monkeypatch.setenv("K", "k")
    monkeypatch.setenv("AZ_KEY", "az")
    monkeypatch.setattr(providers, "_WARMED", set())
    monkeypatch.setattr(providers, "_WARMED_MODELS", set())
    spec = parse_registry(MODEL + POOL)["m"]
    providers.warm_model(spec)
    assert {key[1] for key in providers._WARMED} == {d.base_url for d in spec.deployments}
    before = set(providers._WARMED)
    providers.warm_model(spec)  # once per process and registry entry
    assert before == providers._WARMED and len(providers._WARMED_MODELS) == 1
