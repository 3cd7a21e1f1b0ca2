"""The example registries load, and list what the docs say they list."""

from __future__ import annotations

from pathlib import Path

from batchgen.registry import ProviderKind, parse_registry

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):  # type: ignore[no-untyped-def]
    path = EXAMPLES / name
    return parse_registry(path.read_text(), str(path))


def test_the_providers_example_has_every_kind_and_their_batch_routes():
    registry = _load("models.providers.toml")
    kinds = {spec.provider for spec in registry}
    assert {ProviderKind.GEMINI, ProviderKind.VERTEX, ProviderKind.BEDROCK} <= kinds
    gemini = next(s for s in registry if s.provider is ProviderKind.GEMINI)
    assert gemini.offline_route is not None
    bedrock = next(s for s in registry if s.provider is ProviderKind.BEDROCK)
    assert bedrock.offline_route is not None and bedrock.min_job_requests == 100
    assert (bedrock.offline.storage_uri or "").startswith("s3://") and bedrock.offline.role_arn
    vertex = next(s for s in registry if s.provider is ProviderKind.VERTEX)
    assert vertex.project and vertex.region and vertex.offline_route is not None
    assert (vertex.offline.storage_uri or "").startswith("gs://")


def test_the_openai_compatible_presets():
    registry = _load("models.openai-compatible.toml")
    hosts = {spec.base_url.split("/")[2] for spec in registry}
    assert hosts == {
        "api.mistral.ai",
        "api.groq.com",
        "api.together.xyz",
        "api.deepseek.com",
        "api.fireworks.ai",
    }
    assert all(spec.provider is ProviderKind.OPENAI for spec in registry)
    offloading = {spec.base_url.split("/")[2] for spec in registry if spec.offload}
    assert offloading == {"api.groq.com", "api.together.xyz"}


BASE = """
[models."m"]
provider = "{provider}"
base_url = "https://example.com"
api_key_env = "K"
group = "g"
budget_key = "b"
context_window = 1000
max_output_tokens = 100
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 1
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
{extra}
"""


def test_the_registry_refuses_a_native_kind_without_what_it_needs():
    import pytest

    from batchgen.errors import ConfigError

    cases = [
        ("vertex", "", "needs project and region"),
        ("bedrock", "", "needs region"),
        ("gemini", 'endpoints = ["/v1/responses"]', "serves only /v1/chat/completions"),
        (
            "vertex",
            'project = "p"\nregion = "r"\n[models."m".flex]',
            "service tier; a vertex model has none",
        ),
        ("bedrock", 'region = "us-east-1"\noffload = true', "needs storage_uri"),
        (
            "vertex",
            'project = "p"\nregion = "r"\noffload = true\n[models."m".offline]\n'
            'storage_uri = "s3://x"',
            "needs storage_uri (gs://",
        ),
    ]
    for provider, extra, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
            parse_registry(BASE.format(provider=provider, extra=extra))
    # The Gemini API has a flex tier: its route loads.
    gemini = parse_registry(BASE.format(provider="gemini", extra='[models."m".flex]'))
    assert gemini["m"].offers_flex
