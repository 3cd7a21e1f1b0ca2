"""Provider adapters, chosen by the model's ``provider`` kind in the registry."""

from __future__ import annotations

from app.providers.base import Provider
from app.registry import ModelSpec, ProviderKind


def get_provider(spec: ModelSpec) -> Provider:
    """The adapter for ``spec.provider``."""
    if spec.provider is ProviderKind.ANTHROPIC:
        from app.providers.anthropic import AnthropicProvider

        return AnthropicProvider()
    from app.providers.openai import OpenAIProvider

    return OpenAIProvider()
