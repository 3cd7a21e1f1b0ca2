"""The model registry: a declarative TOML file describing every model clients may use."""

from __future__ import annotations

import difflib
import functools
import os
import re
import tomllib
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from batchgen.errors import ConfigError

QUEUE_PREFIX = "llm."
# The most model names an "unknown model" error lists.
LISTED_MODELS = 20
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ProviderKind(StrEnum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class Endpoint(StrEnum):
    """An OpenAI API a model may serve (a batch line's ``url``, a batch's ``endpoint``)."""

    CHAT_COMPLETIONS = "/v1/chat/completions"
    RESPONSES = "/v1/responses"
    EMBEDDINGS = "/v1/embeddings"


# What a model serves when the registry does not say: a chat model of an OpenAI-format
# server serves chat completions and the Responses API; Anthropic's serve chat (as
# Messages). Embeddings are served only by a model that names them.
DEFAULT_ENDPOINTS = {
    "openai": (Endpoint.CHAT_COMPLETIONS, Endpoint.RESPONSES),
    "anthropic": (Endpoint.CHAT_COMPLETIONS,),
}
# What the Anthropic adapter can call.
ANTHROPIC_ENDPOINTS = frozenset({Endpoint.CHAT_COMPLETIONS})
# The endpoints that generate text (their requests reserve output tokens).
GENERATING = frozenset({Endpoint.CHAT_COMPLETIONS, Endpoint.RESPONSES})


class ChargePolicy(StrEnum):
    """How the provider counts a call against its tokens/min limit."""

    RESERVE = "reserve"  # prompt + max_tokens, at admission (OpenAI)
    ACTUAL = "actual"  # prompt + the output actually produced (Anthropic)


class LimitShape(StrEnum):
    """How the provider's limiter counts tokens and requests over time (see
    :mod:`batchgen.limits.budget`)."""

    # A sliding window: a call counts against the limit for one window (plus a
    # guard), then not at all. Never exceeds any provider's per-minute limit: the
    # safe default, for servers whose limiter is unknown.
    WINDOW = "window"
    # A token bucket of capacity = the limit, refilled continuously at limit per
    # window (OpenAI's and Anthropic's documented limiters): capacity freed by a
    # call returns a little every second, not all at once a minute later.
    BUCKET = "bucket"


class Tier(StrEnum):
    """The provider's service tier a call was served at (each has its own prices)."""

    STANDARD = "standard"
    BATCH = "batch"  # the providers' Batch APIs (about half price)
    FLEX = "flex"  # OpenAI's service_tier="flex" (slower, batch prices)


# What a tier costs against the standard prices when the registry names no price of its
# own (OpenAI and Anthropic both document half price for Batch, OpenAI the same for Flex).
DEFAULT_TIER_MULTIPLIER = {Tier.STANDARD: 1.0, Tier.BATCH: 0.5, Tier.FLEX: 0.5}
# Cached input (a prompt-cache read) and a cache write against the input price, by
# provider, when the model names no price of its own: Anthropic bills reads at 0.1x
# and 5-minute writes at 1.25x; OpenAI bills cached input at 0.5x (newer models lower:
# set cached_input_usd_per_1m) and nothing extra for a write.
DEFAULT_CACHE_READ_MULTIPLIER = {"openai": 0.5, "anthropic": 0.1}
DEFAULT_CACHE_WRITE_MULTIPLIER = {"openai": 1.0, "anthropic": 1.25}


class TierPrices(BaseModel):
    """One tier's prices (``[models."<name>".tiers.<tier>]``): a ``multiplier`` of the
    standard prices, and/or explicit per-1M prices of some token kinds (they win)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    multiplier: float | None = Field(default=None, ge=0)
    input_usd_per_1m: float | None = Field(default=None, ge=0)
    cached_input_usd_per_1m: float | None = Field(default=None, ge=0)
    cache_write_usd_per_1m: float | None = Field(default=None, ge=0)
    output_usd_per_1m: float | None = Field(default=None, ge=0)
    reasoning_usd_per_1m: float | None = Field(default=None, ge=0)


class OfflineRoute(BaseModel):
    """A model's offline route: the provider's own Batch API (``[models."<name>".offline]``).

    Used only when the model says ``offload = true``; the rules that send an item
    there are in :mod:`batchgen.domain.offload`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # How long the provider typically takes for a job (its window is 24 h).
    turnaround_s: PositiveFloat = 3600.0
    # Time always kept back before a deadline to run a late job's items online
    # (beside their drain time at the model's tokens_per_min).
    fallback_s: float = Field(default=600.0, ge=0)
    # The provider's bounds of one job (OpenAI: 50 000 requests, 200 MB).
    max_requests: PositiveInt = 50_000
    max_bytes: PositiveInt = 200_000_000
    # The provider's limit on tokens enqueued in open jobs for this model (None: none).
    enqueued_tokens: PositiveInt | None = None
    # Batch prices; default: half the online prices.
    input_usd_per_1m: float | None = Field(default=None, ge=0)
    output_usd_per_1m: float | None = Field(default=None, ge=0)


class ModelSpec(BaseModel):
    """One model's provider, limits and prices."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    provider: ProviderKind
    base_url: str
    api_key_env: str
    group: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    budget_key: str
    context_window: PositiveInt
    # Required for a model that generates (chat, responses); an embedding model has none.
    max_output_tokens: PositiveInt | None = None
    tokens_per_min: PositiveInt
    requests_per_min: PositiveInt
    max_concurrency: PositiveInt
    input_usd_per_1m: float = Field(ge=0)
    output_usd_per_1m: float = Field(ge=0)
    # Prices of the other token kinds (None: derived, see DEFAULT_CACHE_*_MULTIPLIER;
    # reasoning tokens are billed as output unless priced here).
    cached_input_usd_per_1m: float | None = Field(default=None, ge=0)
    cache_write_usd_per_1m: float | None = Field(default=None, ge=0)
    reasoning_usd_per_1m: float | None = Field(default=None, ge=0)
    # Per-tier prices (None or missing: DEFAULT_TIER_MULTIPLIER of the standard ones).
    tiers: dict[Tier, TierPrices] = Field(default_factory=dict)
    encoding: str = "cl100k_base"
    charge_policy: ChargePolicy = ChargePolicy.RESERVE
    limit_shape: LimitShape = LimitShape.WINDOW
    max_attempts: PositiveInt = 5
    call_timeout_s: PositiveFloat | None = None
    # Open work (estimated tokens) admitted at most; default: BATCHGEN_MAX_BACKLOG_MIN
    # minutes of tokens_per_min. Over it, submits get 503 + Retry-After.
    max_backlog_tokens: PositiveInt | None = None
    # The provider's Batch API for bulk work whose deadline allows it (half price).
    offload: bool = False
    offline: OfflineRoute = OfflineRoute()
    # The APIs the model serves (None: DEFAULT_ENDPOINTS of its provider kind); a request
    # to another is a 400 naming these.
    endpoints: tuple[Endpoint, ...] | None = None
    # An embedding model's vector length (the most a request's ``dimensions`` may ask).
    dimensions: PositiveInt | None = None

    @model_validator(mode="after")
    def _check_endpoints(self) -> ModelSpec:
        served = self.served
        if not served:
            raise ValueError("endpoints: name at least one endpoint")
        if self.provider is ProviderKind.ANTHROPIC and not set(served) <= ANTHROPIC_ENDPOINTS:
            raise ValueError(
                "endpoints: an anthropic model serves only /v1/chat/completions "
                "(and Anthropic's Messages)"
            )
        if self.max_output_tokens is None and GENERATING & set(served):
            raise ValueError("max_output_tokens: required by a model that serves chat or responses")
        if self.dimensions is None and Endpoint.EMBEDDINGS in served:
            raise ValueError("dimensions: required for a model that serves /v1/embeddings")
        return self

    @property
    def served(self) -> tuple[Endpoint, ...]:
        """The endpoints the model serves."""
        if self.endpoints is not None:
            return self.endpoints
        return DEFAULT_ENDPOINTS[self.provider.value]

    def serves(self, endpoint: str) -> bool:
        """Whether a request to ``endpoint`` (e.g. ``/v1/embeddings``) may name this model."""
        return endpoint in self.served

    @property
    def output_cap(self) -> int:
        """The most output tokens one answer may take (0: a model that generates none)."""
        return self.max_output_tokens or 0

    @property
    def offline_route(self) -> OfflineRoute | None:
        """The offline route when the model offloads (``offload = true``), else None."""
        return self.offline if self.offload else None

    def offline_prices(self) -> ModelSpec:
        """This model priced at its batch prices (what an offline answer costs)."""
        route = self.offline
        return self.model_copy(
            update={
                "input_usd_per_1m": route.input_usd_per_1m
                if route.input_usd_per_1m is not None
                else self.input_usd_per_1m / 2,
                "output_usd_per_1m": route.output_usd_per_1m
                if route.output_usd_per_1m is not None
                else self.output_usd_per_1m / 2,
            }
        )

    @property
    def queue(self) -> str:
        """The Celery queue this model's tasks go to."""
        return QUEUE_PREFIX + self.group

    def api_key(self) -> str:
        """The provider API key from the environment (the simulator accepts any)."""
        return os.environ.get(self.api_key_env, "sk-batchgen-local")


class Registry:
    """All models, by name, with their queue groups."""

    def __init__(self, models: dict[str, ModelSpec]):
        self.models = models

    def get(self, name: str) -> ModelSpec | None:
        return self.models.get(name)

    def __getitem__(self, name: str) -> ModelSpec:
        return self.models[name]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.models.values())

    @property
    def names(self) -> list[str]:
        return sorted(self.models)

    def unknown(self, name: str) -> str:
        """What to tell a caller who named a model the registry does not have: the
        closest names first (a typo), then the available ones (at most
        ``LISTED_MODELS``)."""
        names = self.names
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        listed = ", ".join(names[:LISTED_MODELS])
        if len(names) > LISTED_MODELS:
            listed += f" and {len(names) - LISTED_MODELS} more (GET /v1/models)"
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?);" if close else ";"
        return f"unknown model {name!r}{hint} available models: {listed}"

    @property
    def groups(self) -> list[str]:
        return sorted({m.group for m in self.models.values()})

    @property
    def queues(self) -> list[str]:
        return [QUEUE_PREFIX + g for g in self.groups]


def _expand_env(value: str) -> str:
    def sub(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        return os.environ.get(name) or (default if default is not None else "")

    return _ENV_REF.sub(sub, value)


def parse_registry(text: str, source: str = "<string>") -> Registry:
    """Parse registry TOML; raises :class:`ConfigError` naming the model and field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from exc
    tables = data.get("models")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f'{source}: no [models."<name>"] tables')
    models: dict[str, ModelSpec] = {}
    for name, raw in tables.items():
        fields = {k: _expand_env(v) if isinstance(v, str) else v for k, v in raw.items()}
        try:
            models[name] = ModelSpec.model_validate({"name": name, **fields})
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"{source}: model {name!r}: {loc}: {first['msg']}") from exc
    check_shared_budgets(models.values(), source)
    return Registry(models)


SHARED_LIMITS = ("tokens_per_min", "requests_per_min", "limit_shape")


def check_shared_budgets(models: Iterable[ModelSpec], source: str = "<string>") -> None:
    """Models sharing a ``budget_key`` share one provider account, hence one budget:
    they must declare the same limits and limit shape (else one of them may never get
    capacity, or the shared budget would be kept in two incompatible ways)."""
    by_key: dict[str, list[ModelSpec]] = {}
    for spec in models:
        by_key.setdefault(spec.budget_key, []).append(spec)
    for key, specs in sorted(by_key.items()):
        for field in SHARED_LIMITS:
            values = {getattr(m, field) for m in specs}
            if len(values) > 1:
                declared = ", ".join(f"{m.name!r}: {getattr(m, field)}" for m in specs)
                raise ConfigError(
                    f"{source}: models sharing budget_key {key!r} declare different "
                    f"{field} ({declared}); one account has one limit: make them equal"
                )


@functools.cache
def load_registry(path: Path) -> Registry:
    """Load and validate the registry file at ``path`` (cached per path)."""
    return parse_registry(Path(path).read_text(encoding="utf-8"), str(path))


def get_registry() -> Registry:
    """The registry named by the settings (``BATCHGEN_MODELS_FILE``)."""
    from batchgen.config import get_settings

    return load_registry(get_settings().models_file)
