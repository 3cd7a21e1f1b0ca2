"""Cost of a call from the registry's prices (pure, exact in Decimal)."""

from __future__ import annotations

from decimal import Decimal

from batchgen.registry import ModelSpec

MILLION = Decimal(1_000_000)


def cost_usd(prompt_tokens: int, completion_tokens: int, spec: ModelSpec) -> Decimal:
    """Price of one call from the registry's per-1M-token prices, exact in Decimal."""
    return (
        Decimal(prompt_tokens) * Decimal(str(spec.input_usd_per_1m))
        + Decimal(completion_tokens) * Decimal(str(spec.output_usd_per_1m))
    ) / MILLION
