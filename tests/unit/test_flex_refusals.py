"""A flex call refused as busy (429 "resource unavailable") is neither a rate limit nor a
failure; a flex answer is priced at the flex tier; a flex model's lease covers its
longer calls."""

from __future__ import annotations

from decimal import Decimal

import httpx
import openai
import pytest

from batchgen.config import Settings
from batchgen.domain.billing.cost import TokenUsage, price_usage, tier_of
from batchgen.domain.scheduling.pools import breaker_signal, failover_reason
from batchgen.domain.scheduling.settlement import SettleAction, decide_settlement
from batchgen.errors import FlexUnavailable, RateLimited
from batchgen.limits.gate import running_lease_s
from batchgen.providers.base import classify_status
from batchgen.providers.openai import translate
from batchgen.registry import ChargePolicy, Tier, parse_registry
from batchgen.simulator.flex import refusal_body

BUSY = "Resource unavailable (flex processing is at capacity)."


def test_a_429_resource_unavailable_is_a_flex_refusal_not_a_rate_limit():
    by_code = classify_status(429, "HTTP 429", {"retry-after": "3"}, "resource_unavailable")
    assert isinstance(by_code, FlexUnavailable) and not isinstance(by_code, RateLimited)
    assert by_code.retry_after_s == 3.0 and not by_code.billed and by_code.status == 429
    by_words = classify_status(429, "HTTP 429", None, None, provider_message=BUSY)
    assert isinstance(by_words, FlexUnavailable) and by_words.retry_after_s is None
    plain = classify_status(429, "HTTP 429", {"retry-after": "3"}, "rate_limit_exceeded")
    assert isinstance(plain, RateLimited)


def test_the_sdk_error_of_the_simulated_refusal_is_a_flex_refusal():
    request = httpx.Request("POST", "http://sim/v1/chat/completions")
    response = httpx.Response(429, json=refusal_body(), request=request)
    body = refusal_body()["error"]
    exc = openai.RateLimitError("busy", response=response, body=body)
    error = translate(exc)
    assert isinstance(error, FlexUnavailable)
    assert "resource_unavailable" in error.message and "capacity" not in error.message


def test_a_refusal_gives_the_reservation_back_and_starts_no_cooldown():
    refusal = FlexUnavailable("HTTP 429", retry_after_s=5.0)
    settled = decide_settlement(
        charge_policy=ChargePolicy.RESERVE, max_tokens=100, answered=False, error=refusal
    )
    assert settled.action is SettleAction.RELEASE
    assert settled.cooldown_s is None and settled.counters == ()
    limited = decide_settlement(
        charge_policy=ChargePolicy.RESERVE,
        max_tokens=100,
        answered=False,
        error=RateLimited("HTTP 429", retry_after_s=5.0),
    )
    assert limited.cooldown_s == 5.0  # the difference: a rate limit cools the budget down


def test_a_refusal_says_nothing_of_the_deployment():
    refusal = FlexUnavailable("HTTP 429", retry_after_s=None)
    assert failover_reason(refusal) is None
    assert breaker_signal(deployments=3, answered=False, error=refusal) == ""


def test_the_tier_is_the_answers_else_the_routes():
    assert tier_of(False, {"service_tier": "flex"}) is Tier.FLEX
    assert tier_of(False, {"service_tier": "default"}, Tier.FLEX) is Tier.STANDARD
    assert tier_of(False, {}, Tier.FLEX) is Tier.FLEX
    assert tier_of(False, {}) is Tier.STANDARD
    assert tier_of(True, {"service_tier": "flex"}) is Tier.BATCH


REGISTRY = """
[models."m"]
provider = "openai"
base_url = "http://x/v1"
api_key_env = "K"
group = "g"
budget_key = "m"
context_window = 10000
max_output_tokens = 500
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 2
input_usd_per_1m = 0.40
output_usd_per_1m = 1.60
cached_input_usd_per_1m = 0.10
call_timeout_s = 60
"""


def test_flex_is_priced_at_half_and_its_cached_input_too():
    spec = parse_registry(REGISTRY)["m"]
    usage = TokenUsage(prompt_tokens=1600, completion_tokens=100, cached_tokens=1536)
    standard = price_usage(usage, spec, Tier.STANDARD)
    uncached, cached, output = 64 * Decimal("0.40"), 1536 * Decimal("0.10"), 100 * Decimal("1.60")
    assert standard == (uncached + cached + output) / 10**6
    assert price_usage(usage, spec, Tier.FLEX) == standard / 2


@pytest.mark.parametrize(
    ("flex", "lease_s"), [("", 2 * 60 + 30), ("timeout_s = 600\n", 2 * 600 + 30)]
)
def test_a_flex_models_lease_covers_its_flex_calls(flex, lease_s):  # fmt: skip
    text = REGISTRY + (f'[models."m".flex]\n{flex}' if flex else "")
    spec = parse_registry(text)["m"]
    assert running_lease_s(spec, Settings(running_lease_margin_s=30)) == lease_s
