"""Provider adapters, chosen by the model's ``provider`` kind in the registry."""

from __future__ import annotations

from batchgen.providers.base import Provider
from batchgen.registry import ModelSpec, ProviderKind


def get_provider(spec: ModelSpec) -> Provider:
    """The adapter for ``spec.provider``."""
    if spec.provider is ProviderKind.ANTHROPIC:
        from batchgen.providers.anthropic import AnthropicProvider

        return AnthropicProvider()
    from batchgen.providers.openai import OpenAIProvider

    return OpenAIProvider()
