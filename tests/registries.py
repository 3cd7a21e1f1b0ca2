"""A registry builder: models (and pools of deployments) made in memory, with the
limits a test names, for tests of the gate, the budget and settlement."""

from __future__ import annotations

from typing import Any

from batchgen.registry import LimitShape, ModelSpec, ProviderKind, parse_registry


def model_spec(
    tpm: int = 1000,
    rpm: int = 20,
    key: str = "acct",
    shape: LimitShape | None = LimitShape.WINDOW,
    slots: int = 2,
    name: str | None = None,
    **fields: Any,
) -> ModelSpec:
    """An OpenAI-like model ``m-<key>`` (or ``name``) on budget key ``key``, with these
    limits (``shape`` None: left to learn) and any other ``fields`` of a model."""
    return ModelSpec(
        name=name or f"m-{key}",
        provider=ProviderKind("openai"),
        base_url="http://x/v1",
        api_key_env="K",
        group="g",
        budget_key=key,
        context_window=10_000,
        max_output_tokens=500,
        tokens_per_min=tpm,
        requests_per_min=rpm,
        max_concurrency=slots,
        input_usd_per_1m=1,
        output_usd_per_1m=1,
        limit_shape=shape,
        **fields,
    )


def pool_spec(*deployments: tuple[str, int, int, int], shape: str = "window") -> ModelSpec:
    """A model ``pool`` with deployments ``(name, tokens/min, requests/min, slots)``."""
    text = """
[models."pool"]
provider = "openai"
base_url = "http://x/v1"
api_key_env = "K"
group = "pool"
context_window = 10000
max_output_tokens = 500
input_usd_per_1m = 1
output_usd_per_1m = 1
"""
    for name, tpm, rpm, slots in deployments:
        text += f"""
[models."pool".deployments.{name}]
tokens_per_min = {tpm}
requests_per_min = {rpm}
max_concurrency = {slots}
limit_shape = "{shape}"
"""
    return parse_registry(text)["pool"]
