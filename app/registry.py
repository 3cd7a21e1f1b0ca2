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
from urllib.parse import urlsplit

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
# A URL's user and password (``//user:secret@``).
_USERINFO = re.compile(r"//[^/@]*@")


class ProviderKind(StrEnum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    # Azure OpenAI's classic API through the SDK's AzureOpenAI client: the deployment in
    # the path, ``api-version`` in the query, the key in the ``api-key`` header.
    AZURE = "azure"
    # Gemini through the google-genai SDK: the Gemini API (an API key), or Vertex AI
    # (``vertex``: a Google Cloud project, its region and service-account credentials).
    GEMINI = "gemini"
    VERTEX = "vertex"
    # Models on AWS Bedrock through boto3's bedrock-runtime Converse / ConverseStream:
    # the AWS credential chain, the deployment's region.
    BEDROCK = "bedrock"


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
    "azure": (Endpoint.CHAT_COMPLETIONS, Endpoint.RESPONSES),
    "gemini": (Endpoint.CHAT_COMPLETIONS,),
    "vertex": (Endpoint.CHAT_COMPLETIONS,),
    "bedrock": (Endpoint.CHAT_COMPLETIONS,),
}
# What the Anthropic adapter can call.
ANTHROPIC_ENDPOINTS = frozenset({Endpoint.CHAT_COMPLETIONS})
# What each adapter of a native format can call (chat, translated; the Gemini API's
# embedContent too).
NATIVE_ENDPOINTS = {
    "gemini": frozenset({Endpoint.CHAT_COMPLETIONS, Endpoint.EMBEDDINGS}),
    "vertex": frozenset({Endpoint.CHAT_COMPLETIONS}),
    "bedrock": frozenset({Endpoint.CHAT_COMPLETIONS}),
}
# Bedrock batch inference: the fewest records per job.
BEDROCK_MIN_JOB_REQUESTS = 100
# The kinds with a flex tier: OpenAI's ``service_tier: "flex"``, and the Gemini API's
# (``service_tier`` flex on ``generateContent``; Vertex AI's flex is not taken).
FLEX_KINDS = frozenset({"openai", "azure", "gemini"})
# The endpoints that generate text (their requests reserve output tokens).
GENERATING = frozenset({Endpoint.CHAT_COMPLETIONS, Endpoint.RESPONSES})


class ChargePolicy(StrEnum):
    """How the provider counts a call against its tokens/min limit."""

    RESERVE = "reserve"  # prompt + max_tokens, at admission (OpenAI)
    ACTUAL = "actual"  # prompt + the output actually produced (Anthropic)


class LimitShape(StrEnum):
    """How the provider's limiter counts tokens and requests over time (see
    :mod:`batchgen.limits.budget`). A registry entry that sets none starts as a
    bucket and learns the shape from the provider's reset headers
    (:func:`batchgen.domain.scheduling.rate_limits.shape_evidence`)."""

    # A sliding window: a call counts against the limit for one window (plus a
    # guard), then not at all. Never exceeds any provider's per-minute limit.
    WINDOW = "window"
    # A token bucket of capacity = the limit, refilled continuously at limit per
    # window (OpenAI's and Anthropic's documented limiters): capacity freed by a
    # call returns a little every second, not all at once a minute later.
    BUCKET = "bucket"


# What the budget's scripts are told of a deployment that sets no limit_shape: the
# shape learned from its provider's headers (a bucket until they show otherwise).
LEARNED_SHAPE = "learn"


def shape_arg(shape: LimitShape | None) -> str:
    """A deployment's ``limit_shape`` as the budget's scripts read it: ``"window"``,
    ``"bucket"`` or, when the registry sets none, ``"learn"``."""
    return LEARNED_SHAPE if shape is None else shape.value


class Tier(StrEnum):
    """The provider's service tier a call was served at (each has its own prices)."""

    STANDARD = "standard"
    BATCH = "batch"  # the providers' Batch APIs (about half price)
    FLEX = "flex"  # OpenAI's or Gemini's service_tier "flex" (slower, batch prices)


# What a tier costs against the standard prices when the registry names no price of its
# own (OpenAI and Anthropic both document half price for Batch, OpenAI the same for Flex).
DEFAULT_TIER_MULTIPLIER = {Tier.STANDARD: 1.0, Tier.BATCH: 0.5, Tier.FLEX: 0.5}
# Cached input (a prompt-cache read) and a cache write against the input price, by
# provider, when the model names no price of its own: Anthropic bills reads at 0.1x
# and 5-minute writes at 1.25x; OpenAI bills cached input at 0.5x (newer models lower:
# set cached_input_usd_per_1m) and nothing extra for a write.
# Gemini bills cached input at 0.25x (2.5 models; set cached_input_usd_per_1m for
# newer ones) and an implicit cache write as plain input; Bedrock bills its cache as
# Anthropic does (Claude; other models set their own prices).
DEFAULT_CACHE_READ_MULTIPLIER = {
    "openai": 0.5,
    "anthropic": 0.1,
    "azure": 0.5,
    "gemini": 0.25,
    "vertex": 0.25,
    "bedrock": 0.1,
}
DEFAULT_CACHE_WRITE_MULTIPLIER = {
    "openai": 1.0,
    "anthropic": 1.25,
    "azure": 1.0,
    "gemini": 1.0,
    "vertex": 1.0,
    "bedrock": 1.25,
}


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
    there are in :mod:`batchgen.domain.scheduling.offload`.
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
    # The fewest requests the provider takes in one job (default: Bedrock's 100, else
    # 1); a smaller remainder of a batch runs online.
    min_requests: PositiveInt | None = None
    # Bedrock batch inference and Vertex AI batch prediction: the prefix their input
    # and output files go under (``s3://bucket/prefix``, ``gs://bucket/prefix``),
    # Bedrock's service role that reads and writes them, and, for a compatible store
    # or a local endpoint, their URLs (default: AWS's for the deployment's region,
    # Google's).
    storage_uri: str | None = None
    role_arn: str | None = None
    storage_endpoint: str | None = None
    control_url: str | None = None
    # Gemini Batch Mode: a job of up to this many bytes of requests goes inline, a
    # larger one as a JSONL file uploaded to the Files API (Google's inline bound: 20 MB).
    inline_max_bytes: PositiveInt = 20_000_000


class FlexRoute(BaseModel):
    """A model's flex route (``[models."<name>".flex]``): OpenAI's ``service_tier:
    "flex"`` or the Gemini API's, synchronous calls at the batch prices, slower, and
    refused when the provider is busy (OpenAI: a 429 "resource unavailable"; Gemini: a
    503 ``UNAVAILABLE``). The table turns it on (an empty
    one takes the defaults); the rules that send an item there, and back to standard
    calls in time, are in :mod:`batchgen.domain.scheduling.routes`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # How long a flex answer typically takes: a flex call starts only while the deadline
    # leaves this and ``fallback_s``.
    latency_s: PositiveFloat = 60.0
    # The most one flex call may take (OpenAI advises raising the SDK's timeout to 15
    # minutes); it is cut so that ``fallback_s`` is always left.
    timeout_s: PositiveFloat = 900.0
    # Time always kept back before the deadline to run the item as a standard call.
    fallback_s: float = Field(default=300.0, ge=0)
    # The wait after a refusal without a retry-after (doubling, with jitter, up to
    # ``retry_max_s``), and the refusals after which the item runs standard.
    retry_s: PositiveFloat = 5.0
    retry_max_s: PositiveFloat = 120.0
    max_refusals: PositiveInt = 5


# The implicit deployment of a model that declares none (its own fields are its one
# deployment's, its budget and slots keyed as they always were).
DEFAULT_DEPLOYMENT = "default"
# What a deployment takes from its model's table unless it says otherwise.
INHERITED = (
    "provider",
    "base_url",
    "api_key_env",
    "region",
    "api_version",
    "project",
    "limit_shape",
)
# A deployment's own limits: with deployments, the model's are their sums.
POOLED_LIMITS = ("tokens_per_min", "requests_per_min", "max_concurrency")
# What a call served by a deployment takes from it (ModelSpec.at); prices only if set.
_SERVED = (
    *INHERITED,
    *POOLED_LIMITS,
    "azure_deployment",
    "budget_key",
)
_PRICES = (
    "input_usd_per_1m",
    "output_usd_per_1m",
    "cached_input_usd_per_1m",
    "cache_write_usd_per_1m",
    "reasoning_usd_per_1m",
)


class ProviderTarget(BaseModel):
    """Where calls go: the provider, its URL, the variable holding the key (never the
    key), the region, and for Azure OpenAI the deployment and api-version."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: ProviderKind
    base_url: str
    api_key_env: str
    region: str | None = None
    # Azure OpenAI: the deployment (default: the model's name) and the api-version.
    azure_deployment: str | None = None
    api_version: str | None = None
    # Vertex AI: the Google Cloud project (the location is ``region``).
    project: str | None = None

    @model_validator(mode="after")
    def _azure_version(self) -> ProviderTarget:
        if self.provider is ProviderKind.AZURE and not self.api_version:
            raise ValueError("provider azure needs api_version")
        if self.provider is ProviderKind.VERTEX and not (self.project and self.region):
            raise ValueError("provider vertex needs project and region (its location)")
        if self.provider is ProviderKind.BEDROCK and not self.region:
            raise ValueError("provider bedrock needs region")
        return self

    def api_key(self) -> str:
        """The provider API key from the environment (the simulator accepts any)."""
        return os.environ.get(self.api_key_env, "sk-batchgen-local")


class Deployment(ProviderTarget):
    """One deployment of a model (``[models."<name>".deployments.<deployment>]``): a
    provider target (URL, key and region) with its own limits, limit shape and budget in Redis.

    Clients name the model; the gate picks one of its deployments for each call
    (:mod:`batchgen.limits.gate`). The key is read from ``api_key_env``, never stored.
    Prices left out are the model's; ``tiers`` price this deployment's tiers apart.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    budget_key: str
    tokens_per_min: PositiveInt
    requests_per_min: PositiveInt
    max_concurrency: PositiveInt
    # None: not set, learned from the provider's headers (a bucket until they show
    # otherwise).
    limit_shape: LimitShape | None = None
    # Its concurrency slots' key (the model's name for the implicit deployment).
    slot_key: str
    input_usd_per_1m: float | None = Field(default=None, ge=0)
    output_usd_per_1m: float | None = Field(default=None, ge=0)
    cached_input_usd_per_1m: float | None = Field(default=None, ge=0)
    cache_write_usd_per_1m: float | None = Field(default=None, ge=0)
    reasoning_usd_per_1m: float | None = Field(default=None, ge=0)
    tiers: dict[Tier, TierPrices] | None = None
    # False: this deployment serves no flex calls (its model's flex items run standard
    # when the gate picks it).
    flex: bool = True


def _pool_fields(data: dict[str, object]) -> dict[str, object]:
    """A model table with ``deployments``: each deployment completed from the model's
    table (:data:`INHERITED`), keyed apart (budget ``<budget_key>:<name>``, slots
    ``<model>@<name>``), and the model's limits their sums."""
    declared = data.get("deployments")
    if not isinstance(declared, dict) or not declared:
        raise ValueError("deployments must be a table of one or more deployments")
    given = [f for f in POOLED_LIMITS if f in data]
    if given:
        raise ValueError(f"{', '.join(given)}: with deployments, set limits on each deployment")
    model = str(data.get("name", ""))
    budget_key = str(data.setdefault("budget_key", model))
    pool: list[dict[str, object]] = []
    for name, raw in declared.items():
        if not isinstance(raw, dict):
            raise ValueError(f"deployment {name!r} must be a table")
        missing = [f for f in POOLED_LIMITS if f not in raw]
        if missing:
            raise ValueError(f"deployment {name!r} needs {', '.join(missing)}")
        entry = {f: data[f] for f in INHERITED if f in data}
        entry.update(raw, name=name, slot_key=f"{model}@{name}")
        entry.setdefault("budget_key", f"{budget_key}:{name}")
        pool.append(entry)
    first = pool[0]
    for f in ("provider", "base_url", "api_key_env"):
        if f in first:
            data.setdefault(f, first[f])
    for f in POOLED_LIMITS:
        values = [e.get(f) for e in pool]
        if all(isinstance(v, int) and v > 0 for v in values):
            data[f] = sum(values)  # type: ignore[arg-type]
    return {**data, "deployments": tuple(pool)}


class ModelSpec(ProviderTarget):
    """One model's provider, limits and prices, and the deployments that serve it."""

    name: str
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
    # None: not set, learned from the provider's headers (a bucket until they show
    # otherwise; LimitShape).
    limit_shape: LimitShape | None = None
    max_attempts: PositiveInt = 5
    call_timeout_s: PositiveFloat | None = None
    # Open work (estimated tokens) admitted at most; default: BATCHGEN_MAX_BACKLOG_MIN
    # minutes of tokens_per_min. Over it, submits get 503 + Retry-After.
    max_backlog_tokens: PositiveInt | None = None
    # The provider's Batch API for bulk work whose deadline allows it (half price).
    offload: bool = False
    offline: OfflineRoute = OfflineRoute()
    # OpenAI's or Gemini's flex tier for work whose deadline allows it (None: not offered).
    flex: FlexRoute | None = None
    # The shortest prompt prefix the provider caches (Anthropic: 1024 tokens for most
    # models, 2048 or 4096 for some; OpenAI: 1024): a shared prefix this long or longer
    # is released together and, for Anthropic, marked with a cache breakpoint. False:
    # neither (a server that does not cache, or refuses cache_control).
    prompt_cache_min_tokens: PositiveInt = 1024
    prompt_cache: bool = True
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
        vertex = self.offload and self.provider is ProviderKind.VERTEX
        if vertex and not (self.offline.storage_uri or "").startswith("gs://"):
            raise ValueError(
                "offline: Vertex AI batch prediction needs storage_uri (gs://bucket/prefix)"
            )
        if self.offload and self.provider is ProviderKind.BEDROCK:
            route = self.offline
            if not (route.storage_uri or "").startswith("s3://") or not route.role_arn:
                raise ValueError(
                    "offline: Bedrock batch inference needs storage_uri (s3://bucket/prefix) "
                    "and role_arn"
                )
            if "anthropic." not in self.name:
                raise ValueError(
                    "offload: Bedrock batch records are in the model's own format: "
                    "batchgen writes Anthropic Claude's (a model id with 'anthropic.')"
                )
        native = NATIVE_ENDPOINTS.get(self.provider.value)
        if native is not None and not set(served) <= native:
            names = ", ".join(sorted(native))
            raise ValueError(f"endpoints: a {self.provider.value} model serves only {names}")
        if self.max_output_tokens is None and GENERATING & set(served):
            raise ValueError("max_output_tokens: required by a model that serves chat or responses")
        if self.dimensions is None and Endpoint.EMBEDDINGS in served:
            raise ValueError("dimensions: required for a model that serves /v1/embeddings")
        if self.flex is not None and self.provider.value not in FLEX_KINDS:
            article = "an" if self.provider.value[0] in "aeiou" else "a"
            raise ValueError(
                f"flex: OpenAI's and the Gemini API's service tier; {article} "
                f"{self.provider.value} model has none"
            )
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

    # Where its calls go: the declared deployments, or one made of the model's own
    # fields (DEFAULT_DEPLOYMENT).
    deployments: tuple[Deployment, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _declared_pool(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("deployments"), dict):
            return _pool_fields(dict(data))
        return data

    @model_validator(mode="after")
    def _own_deployment(self) -> ModelSpec:
        if not self.deployments:
            own = {f: getattr(self, f) for f in _SERVED}
            own.update(name=DEFAULT_DEPLOYMENT, slot_key=self.name)
            object.__setattr__(self, "deployments", (Deployment.model_validate(own),))
        return self

    @property
    def pooled(self) -> bool:
        """More than one deployment: calls fail over between them."""
        return len(self.deployments) > 1

    @property
    def served_by(self) -> str | None:
        """The name of the one deployment this spec stands for (a model of one, or a
        view made by :meth:`at`), None for a model of several."""
        return self.deployments[0].name if len(self.deployments) == 1 else None

    def deployment(self, name: str | None) -> Deployment:
        """The deployment called ``name`` (None, or one it does not have: the first)."""
        for d in self.deployments:
            if d.name == name:
                return d
        return self.deployments[0]

    def at(self, deployment: Deployment | str | None) -> ModelSpec:
        """This model as one deployment serves it: that deployment's endpoint, key,
        limits, budget and prices (where it sets its own), and it alone. A call's
        provider request, its budget settlement and its ledger price use this view."""
        d = deployment if isinstance(deployment, Deployment) else self.deployment(deployment)
        if self.deployments == (d,):
            return self
        update: dict[str, object] = {f: getattr(d, f) for f in _SERVED}
        update.update({f: getattr(d, f) for f in _PRICES if getattr(d, f) is not None})
        if d.tiers is not None:
            update["tiers"] = d.tiers
        update["deployments"] = (d,)
        if not d.flex:
            update["flex"] = None
        return self.model_copy(update=update)

    @property
    def offers_flex(self) -> bool:
        """The model (as this view's deployments serve it) takes flex calls."""
        return self.flex is not None

    @property
    def min_job_requests(self) -> int:
        """The fewest requests of one provider job (a smaller remainder runs online)."""
        if self.offline.min_requests is not None:
            return self.offline.min_requests
        return BEDROCK_MIN_JOB_REQUESTS if self.provider is ProviderKind.BEDROCK else 1

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


def served_models(registry: Registry, queues: Iterable[str]) -> list[ModelSpec]:
    """The models whose tasks go to one of ``queues`` (a worker's)."""
    wanted = set(queues)
    return [spec for spec in registry if spec.queue in wanted]


def _expand_env(value: str) -> str:
    def sub(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        return os.environ.get(name) or (default if default is not None else "")

    return _ENV_REF.sub(sub, value)


def _expand_all(value: object) -> object:
    """``${VAR}`` and ``${VAR:-default}`` expanded in every string of a model's table,
    its deployments, tiers, flex and offline tables and arrays included."""
    if isinstance(value, str):
        return _expand_env(value)
    if isinstance(value, dict):
        return {k: _expand_all(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_all(v) for v in value]
    return value


def url_problem(url: str) -> str | None:
    """Why no client can call ``url`` (its scheme, host or port), or None: it is usable."""
    if any(c.isspace() for c in url):
        return "contains whitespace"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError as exc:
        return f"does not parse ({exc})"
    if parts.scheme not in ("http", "https"):
        return "needs the scheme http:// or https://"
    if not parts.hostname:
        return "has no host"
    return None


def _unset_reference(value: str) -> str | None:
    """A ``${VAR}`` without a default whose variable is unset or empty (it would leave a
    hole in the URL: ``https://.openai.azure.com``), named; else None."""
    for match in _ENV_REF.finditer(value):
        if match.group(2) is None and not os.environ.get(match.group(1)):
            return f"${{{match.group(1)}}} is unset or empty"
    return None


def _check_base_urls(name: str, raw: dict[str, object], source: str) -> None:
    """Refuse a model's or a deployment's ``base_url`` that no call could use, once
    expanded (a ``${VAR}`` unset leaves ``http://`` or ``/v1``), naming where it is:
    loaded, it would fail every call of the model."""
    declared = raw.get("deployments")
    places: list[tuple[str, object]] = [("", raw)]
    if isinstance(declared, dict):
        places += [(f" deployment {d!r}", table) for d, table in declared.items()]
    for where, table in places:
        value = table.get("base_url") if isinstance(table, dict) else None
        if not isinstance(value, str):
            continue
        expanded = _expand_env(value)
        problem = _unset_reference(value) or url_problem(expanded)
        if problem is not None:
            # A credential, written in the file or from the environment, stays out of
            # the message.
            masked, written = _USERINFO.sub("//***@", expanded), _USERINFO.sub("//***@", value)
            shown = f" (expands to {masked!r})" if expanded != value else ""
            raise ConfigError(
                f"{source}: model {name!r}{where}: base_url {written!r}{shown} is not a"
                f" usable URL: {problem}"
            )


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
        _check_base_urls(name, raw, source)
        fields = {k: _expand_all(v) for k, v in raw.items()}
        try:
            models[name] = ModelSpec.model_validate({"name": name, **fields})
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            where = f"{loc}: " if loc else ""
            msg = first["msg"].removeprefix("Value error, ")
            raise ConfigError(f"{source}: model {name!r}: {where}{msg}") from exc
    check_shared_budgets(models.values(), source)
    return Registry(adopt_shared_shapes(models))


SHARED_LIMITS = ("tokens_per_min", "requests_per_min", "limit_shape")


def check_shared_budgets(models: Iterable[ModelSpec], source: str = "<string>") -> None:
    """Deployments sharing a ``budget_key`` (of one model or several) share one provider
    account, hence one budget: they must declare the same limits and limit shape (else
    one of them may never get capacity, or the shared budget would be kept in two
    incompatible ways)."""
    by_key: dict[str, list[tuple[str, Deployment]]] = {}
    for spec in models:
        for d in spec.deployments:
            label = spec.name if d.name == DEFAULT_DEPLOYMENT else f"{spec.name}@{d.name}"
            by_key.setdefault(d.budget_key, []).append((label, d))
    for key, users in sorted(by_key.items()):
        for field in SHARED_LIMITS:
            values = {getattr(d, field) for _, d in users}
            if field == "limit_shape":
                values.discard(None)  # not set: it takes the one the others set
            if len(values) > 1:
                declared = ", ".join(f"{label!r}: {getattr(d, field)}" for label, d in users)
                raise ConfigError(
                    f"{source}: models sharing budget_key {key!r} declare different "
                    f"{field} ({declared}); one account has one limit: make them equal"
                )


def adopt_shared_shapes(models: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
    """A deployment that sets no ``limit_shape`` but shares its ``budget_key`` with one
    that does takes that shape (one account, one budget, kept one way)."""
    declared: dict[str, LimitShape] = {}
    for spec in models.values():
        for d in spec.deployments:
            if d.limit_shape is not None:
                declared[d.budget_key] = d.limit_shape
    out: dict[str, ModelSpec] = {}
    for name, spec in models.items():
        if not any(d.limit_shape is None and d.budget_key in declared for d in spec.deployments):
            out[name] = spec
            continue
        pool = tuple(
            d.model_copy(update={"limit_shape": declared[d.budget_key]})
            if d.limit_shape is None and d.budget_key in declared
            else d
            for d in spec.deployments
        )
        update: dict[str, object] = {"deployments": pool}
        if not spec.pooled:
            update["limit_shape"] = pool[0].limit_shape
        out[name] = spec.model_copy(update=update)
    return out


@functools.cache
def load_registry(path: Path) -> Registry:
    """Load and validate the registry file at ``path`` (cached per path)."""
    return parse_registry(Path(path).read_text(encoding="utf-8"), str(path))


def get_registry() -> Registry:
    """The registry named by the settings (``BATCHGEN_MODELS_FILE``)."""
    from batchgen.config import get_settings

    return load_registry(get_settings().paths.models_file)
