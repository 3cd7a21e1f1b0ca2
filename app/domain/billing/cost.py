"""Cost of a call from the registry's prices (pure, exact in Decimal).

A provider bills each kind of token at its own price: uncached input, cached input
(OpenAI ``prompt_tokens_details.cached_tokens``, Anthropic ``cache_read_input_tokens``),
cache writes (Anthropic ``cache_creation_input_tokens``), output, and reasoning tokens
(a part of the output, billed as output unless the registry prices them), each at the
tier the call was served at (standard, batch, flex). :func:`usage_of` reads the kinds
from an answer, :func:`prices` resolves the registry's prices of a tier and
:func:`price_usage` is the one function that prices a usage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from batchgen.registry import (
    DEFAULT_CACHE_READ_MULTIPLIER,
    DEFAULT_CACHE_WRITE_MULTIPLIER,
    DEFAULT_TIER_MULTIPLIER,
    ModelSpec,
    Tier,
)

MILLION = Decimal(1_000_000)
KINDS = ("input", "cached_input", "cache_write", "output", "reasoning")


@dataclass(frozen=True)
class TokenUsage:
    """One call's tokens by kind. ``prompt_tokens`` is all input (cached and cache
    writes included), ``completion_tokens`` all output (reasoning included)."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def uncached_input_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens - self.cache_write_tokens)

    @property
    def plain_output_tokens(self) -> int:
        return max(0, self.completion_tokens - self.reasoning_tokens)


@dataclass(frozen=True)
class Prices:
    """USD per 1M tokens of each kind, at one tier."""

    input: Decimal
    cached_input: Decimal
    cache_write: Decimal
    output: Decimal
    reasoning: Decimal


def _dec(value: float | None) -> Decimal | None:
    return None if value is None else Decimal(str(value))


def _or(value: float | None, default: Decimal) -> Decimal:
    return default if value is None else Decimal(str(value))


def _standard(spec: ModelSpec) -> dict[str, Decimal]:
    provider = spec.provider.value
    inp, out = Decimal(str(spec.input_usd_per_1m)), Decimal(str(spec.output_usd_per_1m))
    read = Decimal(str(DEFAULT_CACHE_READ_MULTIPLIER[provider]))
    write = Decimal(str(DEFAULT_CACHE_WRITE_MULTIPLIER[provider]))
    return {
        "input": inp,
        "cached_input": _or(spec.cached_input_usd_per_1m, inp * read),
        "cache_write": _or(spec.cache_write_usd_per_1m, inp * write),
        "output": out,
        "reasoning": _or(spec.reasoning_usd_per_1m, out),
    }


def prices(spec: ModelSpec, tier: Tier = Tier.STANDARD) -> Prices:
    """The registry's prices of ``spec`` at ``tier``: a tier's own price of a kind, else
    (batch) the offline route's input/output price, else the standard price times the
    tier's multiplier (``DEFAULT_TIER_MULTIPLIER`` unless the tier names one)."""
    standard = _standard(spec)
    own = spec.tiers.get(tier)
    multiplier = Decimal(
        str(
            own.multiplier
            if own is not None and own.multiplier is not None
            else DEFAULT_TIER_MULTIPLIER[tier]
        )
    )
    offline = {
        "input": _dec(spec.offline.input_usd_per_1m),
        "output": _dec(spec.offline.output_usd_per_1m),
    }
    resolved: dict[str, Decimal] = {}
    for kind in KINDS:
        explicit = _dec(getattr(own, f"{kind}_usd_per_1m")) if own is not None else None
        if explicit is None and tier is Tier.BATCH:
            explicit = offline.get(kind)
        resolved[kind] = explicit if explicit is not None else standard[kind] * multiplier
    return Prices(**resolved)


def price_usage(usage: TokenUsage, spec: ModelSpec, tier: Tier = Tier.STANDARD) -> Decimal:
    """The price of ``usage`` at ``tier`` from the registry, exact in Decimal."""
    p = prices(spec, tier)
    total = (
        usage.uncached_input_tokens * p.input
        + usage.cached_tokens * p.cached_input
        + usage.cache_write_tokens * p.cache_write
        + usage.plain_output_tokens * p.output
        + usage.reasoning_tokens * p.reasoning
    )
    return total / MILLION


def cost_usd(prompt_tokens: int, completion_tokens: int, spec: ModelSpec) -> Decimal:
    """Price of plain input and output tokens at the standard tier, exact in Decimal."""
    return price_usage(TokenUsage(prompt_tokens, completion_tokens), spec)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _part(usage: Mapping[str, Any], *names: str) -> Mapping[str, Any]:
    for name in names:
        value = usage.get(name)
        if isinstance(value, Mapping):
            return value
    return {}


def usage_of(prompt_tokens: int, completion_tokens: int, body: Mapping[str, Any]) -> TokenUsage:
    """The token kinds of an answer (``body``: its OpenAI chat.completion or Responses
    form, or an Anthropic message's usage keys), within the totals the call reported."""
    usage = body.get("usage") if isinstance(body, Mapping) else None
    if not isinstance(usage, Mapping):
        return TokenUsage(prompt_tokens, completion_tokens)
    inp = _part(usage, "prompt_tokens_details", "input_tokens_details")
    out = _part(usage, "completion_tokens_details", "output_tokens_details")
    cached = _int(inp.get("cached_tokens")) or _int(usage.get("cache_read_input_tokens"))
    written = _int(usage.get("cache_creation_input_tokens"))
    cached = min(cached, prompt_tokens)
    written = min(written, prompt_tokens - cached)
    reasoning = min(_int(out.get("reasoning_tokens")), completion_tokens)
    return TokenUsage(prompt_tokens, completion_tokens, cached, written, reasoning)


def tier_of(offline: bool, body: Mapping[str, Any], requested: Tier = Tier.STANDARD) -> Tier:
    """The tier a call was billed at: a provider Batch API job's rows at batch; an
    online answer at the tier it says it was served at (``service_tier``: ``flex``, any
    other value standard), else at the ``requested`` one (the call's route)."""
    if offline:
        return Tier.BATCH
    said = body.get("service_tier") if isinstance(body, Mapping) else None
    if said == Tier.FLEX.value:
        return Tier.FLEX
    if isinstance(said, str) and said:
        return Tier.STANDARD
    return Tier.STANDARD if requested is Tier.BATCH else requested
