"""The ledger prices each token kind at the tier a call was served at, exactly.

Calls with cached input, cache writes and reasoning tokens are recorded through the
real recording paths (the hot path's one statement, the general path, an offline row)
into PostgreSQL; their ledger rows, results, daily totals and the usage report carry
every kind and the cost worked out by hand from the registry's prices.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import select

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.domain.scheduling.offload import Route
from batchgen.registry import ModelSpec, Registry, Tier, TierPrices, parse_registry
from batchgen.store import db, items
from batchgen.store.ledger import CallOutcome, record_answer, record_success
from batchgen.store.schema import Result, UsageLedger
from batchgen.worker.dispatch import release_all
from tests.helpers import (
    assert_daily_usage_matches_ledger,
    assert_ledger_is_results_plus_waste,
    chat_line,
    make_tenant,
)


def _registry() -> Registry:
    path = Path(get_settings().paths.models_file)
    return parse_registry(path.read_text(encoding="utf-8"), str(path))


def _queue(registry: Registry, model: str, tenant: str, n: int) -> list[int]:
    make_tenant(tenant)
    client.submit_batch([chat_line(f"c{i}", model=model) for i in range(n)], tenant=tenant)
    with db.session_scope() as s:
        released = release_all(s, registry, get_settings())
    return sorted(r.item_id for r in released)


# An OpenAI answer of 10 000 prompt tokens (4 000 of them cached) and 3 000 output
# tokens (1 200 of them reasoning), in the form the provider reports it.
def _openai_answer(item_id: int, **extra: Any) -> CallOutcome:
    return CallOutcome(
        item_id=item_id,
        attempt=1,
        prompt_tokens=10_000,
        completion_tokens=3_000,
        response={
            "choices": [],
            "usage": {
                "prompt_tokens": 10_000,
                "completion_tokens": 3_000,
                "total_tokens": 13_000,
                "prompt_tokens_details": {"cached_tokens": 4_000},
                "completion_tokens_details": {"reasoning_tokens": 1_200},
            },
            **extra,
        },
    )


def _priced(spec: ModelSpec) -> ModelSpec:
    return spec.model_copy(
        update={
            "input_usd_per_1m": 2.0,
            "output_usd_per_1m": 8.0,
            "cached_input_usd_per_1m": 0.5,
            # flex: half price (the default multiplier), cached input priced on its own
            "tiers": {Tier.FLEX: TierPrices(cached_input_usd_per_1m=0.125)},
        }
    )


def _ledger() -> dict[int, tuple]:
    with db.session_scope() as s:
        rows = s.execute(
            select(
                UsageLedger.item_id,
                UsageLedger.cost_usd,
                UsageLedger.cached_tokens,
                UsageLedger.cache_write_tokens,
                UsageLedger.reasoning_tokens,
                UsageLedger.route,
            )
        ).all()
    return {r[0]: tuple(r[1:]) for r in rows}


def test_ledger_prices_cached_and_reasoning_tokens_at_each_tier_exactly(clean_db):
    registry = _registry()
    spec = _priced(registry["sim-small"])
    standard, flex, batch = _queue(registry, "sim-small", "tiers", 3)

    with db.autocommit() as connection:  # the hot path's one statement
        claimed = items.claim(connection, standard, 60.0)
        assert claimed is not None
        assert record_answer(connection, claimed, _openai_answer(standard), spec).recorded
    with db.autocommit() as connection:
        assert items.claim(connection, flex, 60.0) is not None
    with db.session_scope() as s:  # the general path, an answer served at flex
        assert record_success(s, _openai_answer(flex, service_tier="flex"), spec)
    with db.autocommit() as connection:
        assert items.claim(connection, batch, 60.0) is not None
    with db.session_scope() as s:  # a row of a provider Batch API job
        assert record_success(s, _openai_answer(batch), spec, Route.OFFLINE)

    # standard: 6 000 x 2 + 4 000 x 0.5 + 1 800 x 8 + 1 200 x 8 (reasoning as output)
    standard_usd = Decimal("0.038")
    # flex: half of input and output, cached input at its own 0.125
    flex_usd = (6_000 * Decimal(1) + 4_000 * Decimal("0.125") + 3_000 * Decimal(4)) / 10**6
    assert flex_usd == Decimal("0.0185")
    assert _ledger() == {
        standard: (standard_usd, 4_000, 0, 1_200, "online"),
        flex: (flex_usd, 4_000, 0, 1_200, "online"),
        batch: (Decimal("0.019"), 4_000, 0, 1_200, "offline"),
    }
    with db.session_scope() as s:
        results = dict(s.execute(select(Result.item_id, Result.cost_usd)).all())
        kinds = s.execute(select(Result.cached_tokens, Result.reasoning_tokens)).all()
    assert results == {standard: standard_usd, flex: flex_usd, batch: Decimal("0.019")}
    assert kinds == [(4_000, 1_200)] * 3
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()

    [row] = client.usage(tenant="tiers")
    assert (row["cached_tokens"], row["cache_write_tokens"], row["reasoning_tokens"]) == (
        12_000,
        0,
        3_600,
    )
    assert Decimal(row["cost_usd"]) == standard_usd + flex_usd + Decimal("0.019")


def test_ledger_prices_anthropic_cache_reads_and_writes(clean_db):
    """Anthropic: cache reads at 0.1x the input price, cache writes at 1.25x (the
    registry's defaults for the provider), as the provider's answer reports them."""
    registry = _registry()
    spec = registry["sim-claude"]  # input 3.00, output 15.00 per 1M
    [item_id] = _queue(registry, "sim-claude", "cache", 1)
    answer = CallOutcome(
        item_id=item_id,
        attempt=1,
        prompt_tokens=1_000,
        completion_tokens=100,
        response={
            "choices": [],
            "usage": {
                "prompt_tokens": 1_000,
                "completion_tokens": 100,
                "prompt_tokens_details": {"cached_tokens": 500},
                "cache_read_input_tokens": 500,
                "cache_creation_input_tokens": 300,
            },
        },
    )
    with db.autocommit() as connection:
        assert items.claim(connection, item_id, 60.0) is not None
    with db.session_scope() as s:
        assert record_success(s, answer, spec)
    # 200 x 3 + 300 x 3.75 + 500 x 0.30 + 100 x 15
    assert _ledger() == {item_id: (Decimal("0.003375"), 500, 300, 0, "online")}
    assert_daily_usage_matches_ledger()
