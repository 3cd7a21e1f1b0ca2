"""Three routes by deadline (batchgen.domain.scheduling.routes), at the edges of each deadline."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.domain.lifecycle.status import Priority
from batchgen.domain.scheduling.offload import OfflineWindow, OffloadMode
from batchgen.domain.scheduling.routes import (
    DEFAULT_FLEX,
    AfterRefusal,
    FlexWindow,
    ItemRoute,
    RouteMode,
    Routes,
    after_flex_refusal,
    call_route,
    choose_route,
    flex_fits,
    flex_timeout_s,
    flex_window,
    offload_of,
    parse_route,
    with_service_tier,
)
from batchgen.errors import ConfigError, ValidationFailed
from batchgen.registry import Tier, parse_registry

# Batch API: a job in an hour, 600 s kept back. Flex: answers in 60 s, 300 s kept back.
BATCH = OfflineWindow(turnaround_s=3600.0, fallback_s=600.0)
FLEX = FlexWindow(latency_s=60.0, timeout_s=900.0, fallback_s=300.0, retry_s=5.0, max_refusals=4)
BOTH = Routes(batch=BATCH, flex=FLEX, flex_on_request=True)
BATCH_EDGE = 3600.0 + 600.0  # turnaround + fallback
FLEX_EDGE = 60.0 + 300.0  # latency + fallback
JUST_UNDER = 1e-6


def route(left_s: float, *, mode=RouteMode.AUTO, offload=OffloadMode.AUTO, priority=Priority.BULK,
          routes=BOTH, asked=False) -> ItemRoute:  # fmt: skip
    return choose_route(
        mode=mode,
        offload=offload,
        priority=priority,
        routes=routes,
        deadline_left_s=left_s,
        asked_flex=asked,
    )


@pytest.mark.parametrize(
    ("left_s", "expected"),
    [
        (86_400.0, ItemRoute.BATCH),
        (BATCH_EDGE, ItemRoute.BATCH),
        (BATCH_EDGE - JUST_UNDER, ItemRoute.FLEX),
        (FLEX_EDGE, ItemRoute.FLEX),
        (FLEX_EDGE - JUST_UNDER, ItemRoute.STANDARD),
        (30.0, ItemRoute.STANDARD),
    ],
)
def test_auto_bulk_goes_batch_then_flex_then_standard_as_the_deadline_nears(left_s, expected):
    assert route(left_s) is expected


def test_auto_without_a_batch_route_uses_flex_for_far_deadlines_too():
    assert route(86_400.0, routes=Routes(flex=FLEX)) is ItemRoute.FLEX
    assert route(86_400.0, offload=OffloadMode.NEVER) is ItemRoute.FLEX


def test_auto_without_a_flex_route_keeps_the_rest_standard():
    assert route(BATCH_EDGE - JUST_UNDER, routes=Routes(batch=BATCH)) is ItemRoute.STANDARD
    assert route(86_400.0, routes=Routes()) is ItemRoute.STANDARD


@pytest.mark.parametrize("priority", [Priority.INTERACTIVE, Priority.CALL])
def test_auto_keeps_interactive_work_and_calls_standard(priority):
    assert route(86_400.0, priority=priority) is ItemRoute.STANDARD


def test_standard_is_standard_whatever_the_deadline():
    assert route(86_400.0, mode=RouteMode.STANDARD) is ItemRoute.STANDARD
    assert route(86_400.0, mode=RouteMode.STANDARD, asked=True) is ItemRoute.STANDARD


@pytest.mark.parametrize("priority", [Priority.INTERACTIVE, Priority.BULK])
def test_flex_mode_is_flex_while_it_fits_whatever_the_priority(priority):
    flex = RouteMode.FLEX
    assert route(86_400.0, mode=flex, priority=priority) is ItemRoute.FLEX
    assert route(FLEX_EDGE, mode=flex, priority=priority) is ItemRoute.FLEX
    assert route(FLEX_EDGE - JUST_UNDER, mode=flex, priority=priority) is ItemRoute.STANDARD
    assert route(86_400.0, mode=flex, priority=Priority.CALL) is ItemRoute.STANDARD


def test_batch_mode_is_the_batch_api_while_its_fallback_fits():
    offload = offload_of(RouteMode.BATCH, OffloadMode.AUTO)
    assert offload is OffloadMode.ALWAYS
    batch = {"mode": RouteMode.BATCH, "offload": offload, "priority": Priority.INTERACTIVE}
    assert route(600.0 + JUST_UNDER * 1e3, **batch) is ItemRoute.BATCH
    assert route(600.0, **batch) is ItemRoute.STANDARD


def test_a_line_that_asks_for_flex_gets_it_while_it_fits_even_as_a_call():
    call = {"priority": Priority.CALL, "asked": True}
    assert route(FLEX_EDGE, **call) is ItemRoute.FLEX
    assert route(FLEX_EDGE - JUST_UNDER, **call) is ItemRoute.STANDARD
    # A model that declares no flex route: the defaults hold the line to their room.
    undeclared = Routes(flex_on_request=True)
    default_edge = DEFAULT_FLEX.latency_s + DEFAULT_FLEX.fallback_s
    assert route(default_edge, routes=undeclared, **call) is ItemRoute.FLEX
    assert route(default_edge - JUST_UNDER, routes=undeclared, **call) is ItemRoute.STANDARD
    # An Anthropic model has no flex tier: the line's word is not acted on.
    assert route(86_400.0, routes=Routes(), **call) is ItemRoute.STANDARD
    # A batch forced to the Batch API stays there.
    forced = {"mode": RouteMode.BATCH, "offload": OffloadMode.ALWAYS}
    assert route(86_400.0, asked=True, **forced) is ItemRoute.BATCH


def test_route_options_parse_and_must_agree_with_offload():
    assert parse_route(None) is RouteMode.AUTO
    assert parse_route("flex") is RouteMode.FLEX
    with pytest.raises(ValidationFailed, match="route must be one of") as bad:
        parse_route("cheapest")
    assert bad.value.field == "route"
    assert offload_of(RouteMode.AUTO, OffloadMode.NEVER) is OffloadMode.NEVER
    assert offload_of(RouteMode.STANDARD, OffloadMode.AUTO) is OffloadMode.NEVER
    assert offload_of(RouteMode.STANDARD, OffloadMode.NEVER) is OffloadMode.NEVER
    assert offload_of(RouteMode.FLEX, OffloadMode.AUTO) is OffloadMode.NEVER
    for route_mode, offload in [
        (RouteMode.STANDARD, OffloadMode.ALWAYS),
        (RouteMode.FLEX, OffloadMode.ALWAYS),
        (RouteMode.BATCH, OffloadMode.NEVER),
    ]:
        with pytest.raises(ValidationFailed, match="disagree"):
            offload_of(route_mode, offload)


def test_at_the_call_a_flex_item_runs_flex_only_while_it_fits():
    assert call_route(ItemRoute.FLEX, FLEX, FLEX_EDGE) is ItemRoute.FLEX
    assert call_route(ItemRoute.FLEX, FLEX, FLEX_EDGE - JUST_UNDER) is ItemRoute.STANDARD
    assert call_route(ItemRoute.FLEX, None, 86_400.0) is ItemRoute.STANDARD  # no flex there
    assert call_route(ItemRoute.STANDARD, FLEX, 86_400.0) is ItemRoute.STANDARD
    # Back online from the Batch API: standard where the model declares no flex route.
    assert call_route(ItemRoute.BATCH, FLEX, 86_400.0) is ItemRoute.STANDARD


def test_an_item_back_online_from_the_batch_api_runs_flex_where_it_is_offered():
    """Its job failed, expired or ran late: flex at the batch prices still, where the
    model declares flex and the deadline leaves room, never standard at twice them."""
    assert call_route(ItemRoute.BATCH, FLEX, FLEX_EDGE, flex_offered=True) is ItemRoute.FLEX
    late = FLEX_EDGE - JUST_UNDER
    assert call_route(ItemRoute.BATCH, FLEX, late, flex_offered=True) is ItemRoute.STANDARD
    assert call_route(ItemRoute.BATCH, None, 86_400.0, flex_offered=True) is ItemRoute.STANDARD
    assert call_route(ItemRoute.STANDARD, FLEX, 86_400.0, flex_offered=True) is ItemRoute.STANDARD


@given(
    route=st.sampled_from(list(ItemRoute)),
    offered=st.booleans(),
    left_s=st.floats(0, 200_000, allow_nan=False),
)
def test_a_call_never_costs_more_than_its_route_allows(route, offered, left_s):
    """A call is flex only if its deadline leaves room; an item bound for a cheaper
    route (flex, or the Batch API back online) never calls standard where flex fits."""
    chosen = call_route(route, FLEX, left_s, flex_offered=offered)
    if chosen is ItemRoute.FLEX:
        assert flex_fits(FLEX, left_s)
    cheaper = route is ItemRoute.FLEX or (route is ItemRoute.BATCH and offered)
    if cheaper and flex_fits(FLEX, left_s):
        assert chosen is ItemRoute.FLEX


def test_a_flex_call_always_leaves_the_fallback():
    assert flex_timeout_s(FLEX, 5000.0) == 900.0
    assert flex_timeout_s(FLEX, 1000.0) == 700.0
    assert flex_timeout_s(FLEX, FLEX_EDGE) == 60.0
    assert flex_timeout_s(FLEX, 100.0) == 0.0


def test_the_body_says_flex_only_on_a_flex_call():
    body = {"model": "m", "messages": [], "service_tier": "flex"}
    plain = {"model": "m", "messages": []}
    assert with_service_tier(plain, ItemRoute.FLEX) == {**plain, "service_tier": "flex"}
    assert with_service_tier(body, ItemRoute.STANDARD) == plain
    assert body["service_tier"] == "flex"  # not changed in place
    assert with_service_tier(plain, ItemRoute.STANDARD) is plain
    priority = {**plain, "service_tier": "priority"}
    assert with_service_tier(priority, ItemRoute.STANDARD) is priority


def test_a_refusal_waits_for_flex_while_the_deadline_leaves_room_after_the_wait():
    rng = random.Random(7)
    roomy = after_flex_refusal(
        refusals=1, flex=FLEX, retry_after_s=10.0, time_left_s=1000.0, rng=rng
    )
    assert roomy.action is AfterRefusal.RETRY_FLEX and 10.0 <= roomy.wait_s <= 11.0
    # The provider asks for 10 s (plus up to 10 % jitter): 371 s leaves room, 360 s not.
    fits = after_flex_refusal(
        refusals=1, flex=FLEX, retry_after_s=10.0, time_left_s=FLEX_EDGE + 11.0, rng=rng
    )
    assert fits.action is AfterRefusal.RETRY_FLEX
    tight = after_flex_refusal(
        refusals=1, flex=FLEX, retry_after_s=10.0, time_left_s=FLEX_EDGE + 9.99, rng=rng
    )
    assert tight.action is AfterRefusal.STANDARD and tight.wait_s == 0.0


def test_a_refusal_without_retry_after_backs_off_under_a_cap():
    rng = random.Random(3)
    waits = [
        after_flex_refusal(
            refusals=n, flex=FLEX, retry_after_s=None, time_left_s=86_400.0, rng=rng
        ).wait_s
        for n in (1, 2, 3)
    ]
    assert waits[0] <= 5.0 and waits[1] <= 10.0 and waits[2] <= 20.0


def test_refusals_up_to_the_cap_then_a_standard_call():
    under = after_flex_refusal(refusals=3, flex=FLEX, retry_after_s=1.0, time_left_s=86_400.0)
    assert under.action is AfterRefusal.RETRY_FLEX
    capped = after_flex_refusal(refusals=4, flex=FLEX, retry_after_s=1.0, time_left_s=86_400.0)
    assert capped.action is AfterRefusal.STANDARD and "4 times" in capped.message


def test_each_route_has_its_price_tier():
    assert ItemRoute.STANDARD.tier is Tier.STANDARD
    assert ItemRoute.FLEX.tier is Tier.FLEX
    assert ItemRoute.BATCH.tier is Tier.BATCH


def model(name: str, provider: str = "openai") -> str:
    """A model table of one deployment (its own budget)."""
    return f"""
[models."{name}"]
provider = "{provider}"
base_url = "http://x/v1"
api_key_env = "K"
group = "g"
budget_key = "{name}"
context_window = 10000
max_output_tokens = 500
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 2
input_usd_per_1m = 1
output_usd_per_1m = 1"""


REGISTRY = """
[models."gpt-flex"]
provider = "openai"
base_url = "http://x/v1"
api_key_env = "K"
group = "g"
context_window = 10000
max_output_tokens = 500
input_usd_per_1m = 1
output_usd_per_1m = 1

[models."gpt-flex".flex]
latency_s = 30
fallback_s = 120

[models."gpt-flex".deployments.east]
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 2

[models."gpt-flex".deployments.west]
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 2
flex = false
{plain}
call_timeout_s = 45

{claude}
"""


TEXT = REGISTRY.replace("{plain}", model("gpt-plain")).replace(
    "{claude}", model("claude", "anthropic")
)


def test_the_registry_declares_flex_per_model_and_a_deployment_may_opt_out():
    registry = parse_registry(TEXT)
    spec = registry["gpt-flex"]
    assert spec.offers_flex and spec.flex is not None and spec.flex.latency_s == 30
    east, west = spec.at("east"), spec.at("west")
    assert flex_window(spec, east, 120.0) == FlexWindow.of(spec.flex)
    assert flex_window(spec, west, 120.0) is None  # west serves no flex calls
    plain = registry["gpt-plain"]
    assert not plain.offers_flex
    # A line asking for flex itself on a model without a flex route: the defaults, held
    # within the model's own call timeout.
    assert flex_window(plain, plain, 45.0) == FlexWindow(
        DEFAULT_FLEX.latency_s, 45.0, DEFAULT_FLEX.fallback_s
    )
    claude = registry["claude"]
    assert flex_window(claude, claude, 120.0) is None
    with pytest.raises(ConfigError, match="anthropic model has none"):
        claude_flex = '[models."claude".flex]\n[models."claude"]'
        parse_registry(TEXT.replace('[models."claude"]', claude_flex))
