"""Provider adapters, chosen by the model's ``provider`` kind in the registry."""

from __future__ import annotations

from batchgen.providers.base import Provider, UnusableProvider, unusable_client
from batchgen.registry import ModelSpec, ProviderKind

# (provider, base URL, key env) of the clients this process has built: a first call
# builds its SDK client (imports, TLS context, pool) before its item is marked sent.
_WARMED: set[tuple[str, ...]] = set()


def warmed_provider(spec: ModelSpec) -> Provider:
    """The adapter for ``spec`` with its client built once per process (``warm``), so
    what a first call would build (the SDK's imports and client: seconds in a fresh
    process) never sits between an item being marked sent and its request leaving.
    A client that cannot be built gives :class:`UnusableProvider`."""
    provider = get_provider(spec)
    key = (spec.provider.value, spec.base_url, spec.api_key_env, spec.azure_deployment or "")
    if key not in _WARMED:
        try:
            provider.warm(spec)
        except Exception as exc:  # noqa: BLE001 - building a client sends nothing
            # A client no configuration of this deployment can build (its base_url, its
            # key): its calls fail as such, instead of raising before the item's claim.
            return UnusableProvider(unusable_client(exc))
        _WARMED.add(key)
    return provider


# The registry entries (by name and object) whose deployments' clients this process
# has built, before any of their calls took budget (:func:`warm_model`).
_WARMED_MODELS: set[tuple[str, int]] = set()


def warm_model(spec: ModelSpec) -> None:
    """Build the clients of every deployment of ``spec`` (:func:`warmed_provider`), once
    per process and registry entry, before a call of it enters the gate: a first call's
    SDK imports (seconds in a fresh process without ``BATCHGEN_WARM_UP``) then never
    sit between the budget's yes and the request, where the provider would count the
    call later than the budget did."""
    key = (spec.name, id(spec))
    if key in _WARMED_MODELS:
        return
    for deployment in spec.deployments:
        warmed_provider(spec.at(deployment))
    _WARMED_MODELS.add(key)


def get_provider(spec: ModelSpec) -> Provider:
    """The adapter for ``spec.provider``."""
    if spec.provider is ProviderKind.ANTHROPIC:
        from batchgen.providers.anthropic import AnthropicProvider

        return AnthropicProvider()
    if spec.provider in (ProviderKind.GEMINI, ProviderKind.VERTEX):
        from batchgen.providers.gemini import GeminiProvider

        return GeminiProvider()
    if spec.provider is ProviderKind.BEDROCK:
        from batchgen.providers.bedrock import BedrockProvider

        return BedrockProvider()
    from batchgen.providers.openai import OpenAIProvider

    return OpenAIProvider()
