"""Attributes of batchgen's spans and metrics: the GenAI conventions' and its own (pure).

Names follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``) beside
batchgen's own (``batchgen.*``). Only ids, names, counts, times and money: a builder
takes no request or answer body, so no prompt or completion text can reach an
attribute.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

from batchgen.registry import ModelSpec, ProviderKind, Tier

Attributes = dict[str, str | int | float | bool]

# The conventions' well-known values of gen_ai.provider.name, by provider kind.
PROVIDER_NAMES: Mapping[ProviderKind, str] = {
    ProviderKind.OPENAI: "openai",
    ProviderKind.ANTHROPIC: "anthropic",
    ProviderKind.AZURE: "azure.ai.openai",
    ProviderKind.GEMINI: "gcp.gemini",
    ProviderKind.VERTEX: "gcp.vertex_ai",
    ProviderKind.BEDROCK: "aws.bedrock",
}
# gen_ai.operation.name by the endpoint a line calls.
OPERATIONS: Mapping[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/v1/embeddings": "embeddings",
}
# The conventions' bucket boundaries of the two client histograms.
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)
TOKEN_USAGE = "gen_ai.client.token.usage"
OPERATION_DURATION = "gen_ai.client.operation.duration"
TIME_TO_FIRST_CHUNK = "gen_ai.client.operation.time_to_first_chunk"


@dataclass(frozen=True)
class CallInfo:
    """What a span of one provider call says about it (ids and names only)."""

    model: str
    spec: ModelSpec  # the model as the deployment serving the call
    endpoint: str
    tenant: str
    batch_id: str
    item_id: int
    attempt: int
    route: str
    stream: bool
    tier: Tier = Tier.STANDARD


def operation_name(endpoint: str) -> str:
    return OPERATIONS.get(endpoint, "chat")


def provider_name(spec: ModelSpec) -> str:
    return PROVIDER_NAMES.get(spec.provider, str(spec.provider))


def span_name(info: CallInfo) -> str:
    """The conventions' span name: ``{gen_ai.operation.name} {gen_ai.request.model}``."""
    return f"{operation_name(info.endpoint)} {info.model}"


def item_attributes(tenant: str, batch_id: str, item_id: int, attempt: int) -> Attributes:
    """batchgen's attributes of every span of an item."""
    return {
        "batchgen.tenant": tenant,
        "batchgen.batch_id": batch_id,
        "batchgen.item_id": item_id,
        "batchgen.attempt": attempt,
    }


def metric_attributes(info: CallInfo) -> Attributes:
    """The attributes of the client histograms (low cardinality: no ids)."""
    return {
        "gen_ai.operation.name": operation_name(info.endpoint),
        "gen_ai.provider.name": provider_name(info.spec),
        "gen_ai.request.model": info.model,
        "batchgen.deployment": info.spec.served_by or info.model,
    }


def request_attributes(info: CallInfo) -> Attributes:
    """A provider call's span attributes known before it is sent."""
    return {
        **metric_attributes(info),
        **item_attributes(info.tenant, info.batch_id, info.item_id, info.attempt),
        "batchgen.route": info.route,
        "gen_ai.request.stream": info.stream,
    }


def response_attributes(
    response_model: str | None,
    response_id: str | None,
    finish_reason: str | None,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int,
    cost_usd: Decimal,
) -> Attributes:
    """A provider call's span attributes from its answer (counts and ids, no text)."""
    attrs: Attributes = {
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
        "batchgen.cost_usd": float(cost_usd),
    }
    if cached_tokens:
        attrs["gen_ai.usage.cache_read.input_tokens"] = cached_tokens
    if response_model:
        attrs["gen_ai.response.model"] = response_model
    if response_id:
        attrs["gen_ai.response.id"] = response_id
    if finish_reason:
        attrs["gen_ai.response.finish_reasons"] = finish_reason
    return attrs


def error_type(exc: BaseException) -> str:
    """``error.type``: the error's class (its message may quote the request)."""
    return getattr(exc, "code", None) or type(exc).__name__


def response_model_of(body: Mapping[str, object]) -> str | None:
    model = body.get("model") if isinstance(body, Mapping) else None
    return model if isinstance(model, str) else None


def item_trace_ids(batch_id: str, item_id: int) -> tuple[int, int]:
    """The trace id and root span id of an item's trace, derived from its ids, so that
    every process that touches the item (dispatcher, workers, a synchronous caller)
    joins the same trace without storing anything."""
    return _ids(f"item/{batch_id}/{item_id}")


def batch_trace_ids(batch_id: str) -> tuple[int, int]:
    """The trace id and span id of a batch's submit span (each item's root links it)."""
    return _ids(f"batch/{batch_id}")


def _ids(key: str) -> tuple[int, int]:
    digest = hashlib.sha256(key.encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id
