"""Pricing a usage by token kind and tier (pure, exact in Decimal)."""

from __future__ import annotations

from decimal import Decimal

from batchgen.domain.billing.cost import TokenUsage, price_usage, prices, tier_of, usage_of
from batchgen.registry import ModelSpec, OfflineRoute, Tier, TierPrices


def _spec(**kw: object) -> ModelSpec:
    fields: dict[str, object] = {
        "name": "m",
        "provider": "openai",
        "base_url": "http://x",
        "api_key_env": "K",
        "group": "g",
        "budget_key": "b",
        "context_window": 1000,
        "max_output_tokens": 100,
        "tokens_per_min": 1000,
        "requests_per_min": 10,
        "max_concurrency": 1,
        "input_usd_per_1m": 1.0,
        "output_usd_per_1m": 4.0,
    }
    fields.update(kw)
    return ModelSpec.model_validate(fields)


def test_default_prices_per_provider_and_tier():
    openai = prices(_spec())
    assert (openai.cached_input, openai.cache_write, openai.reasoning) == (
        Decimal("0.5"),
        Decimal("1.0"),
        Decimal("4.0"),
    )
    claude = prices(_spec(provider="anthropic", input_usd_per_1m=3.0))
    assert (claude.cached_input, claude.cache_write) == (Decimal("0.30"), Decimal("3.750"))
    assert prices(_spec(), Tier.BATCH).input == Decimal("0.5")
    assert prices(_spec(), Tier.FLEX).output == Decimal("2.0")


def test_explicit_prices_win_over_multipliers():
    spec = _spec(
        reasoning_usd_per_1m=6.0,
        cached_input_usd_per_1m=0,
        tiers={"flex": TierPrices(multiplier=0.25, output_usd_per_1m=3.0)},
        offline=OfflineRoute(input_usd_per_1m=0.4),
    )
    assert prices(spec).cached_input == 0  # a price of 0 is a price, not "unset"
    assert prices(spec).reasoning == Decimal("6.0")
    flex = prices(spec, Tier.FLEX)
    assert (flex.input, flex.output, flex.reasoning) == (
        Decimal("0.250"),
        Decimal("3.0"),
        Decimal("1.500"),
    )
    assert prices(spec, Tier.BATCH).input == Decimal("0.4")  # the offline route's price


def test_price_usage_by_kind():
    usage = TokenUsage(1000, 500, cached_tokens=200, cache_write_tokens=100, reasoning_tokens=300)
    # 700 x 1 + 200 x 0.5 + 100 x 1 + 200 x 4 + 300 x 4
    assert price_usage(usage, _spec()) == Decimal("0.0029")
    assert price_usage(usage, _spec(), Tier.BATCH) == Decimal("0.00145")


def test_usage_of_reads_both_providers_and_the_responses_form():
    assert usage_of(10, 5, {}) == TokenUsage(10, 5)
    openai = {
        "usage": {
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": 2},
        }
    }
    assert usage_of(10, 5, openai) == TokenUsage(10, 5, 4, 0, 2)
    responses = {
        "usage": {
            "input_tokens_details": {"cached_tokens": 3},
            "output_tokens_details": {"reasoning_tokens": 1},
        }
    }
    assert usage_of(10, 5, responses) == TokenUsage(10, 5, 3, 0, 1)
    claude = {"usage": {"cache_read_input_tokens": 6, "cache_creation_input_tokens": 9}}
    # never more of a kind than the total the call reported
    assert usage_of(10, 5, claude) == TokenUsage(10, 5, 6, 4, 0)
    assert usage_of(10, 5, {"usage": {"prompt_tokens_details": None}}) == TokenUsage(10, 5)


def test_tier_of():
    assert tier_of(True, {"service_tier": "flex"}) is Tier.BATCH
    assert tier_of(False, {"service_tier": "flex"}) is Tier.FLEX
    assert tier_of(False, {"service_tier": "default"}) is Tier.STANDARD
