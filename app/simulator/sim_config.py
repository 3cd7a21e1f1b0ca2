"""Configuration of the provider simulator.

Charge modes (what a request costs against ``tokens_per_min``):

``"reserve"`` (OpenAI): at admission the request is charged
    ``prompt_tokens + max_tokens`` and that charge is final, whatever the model
    really writes.
``"actual"`` (Anthropic-like): admission still *checks and reserves*
    ``prompt_tokens + max_tokens`` (so the window can never be overrun by
    outputs that are still being generated); when the answer ends (complete,
    cancelled or failed) the charge is lowered to ``prompt_tokens +
    completion_tokens actually sent``, which frees the unused part of the
    reservation for later requests. Charges only ever go down, so the
    guarantee "admitted tokens in any window <= tokens_per_min" holds on the
    final charges too.

Limiters (``limiter``):

``"window"`` (the default): an exact sliding window, at most ``tokens_per_min``
    / ``requests_per_min`` admitted in any ``window_s`` seconds; a request is
    charged ``prompt_tokens`` (tiktoken, the client's own count) ``+ max_tokens``.
``"bucket"`` (like OpenAI's continuously replenishing limits): a token bucket
    of capacity ``tokens_per_min`` (and one of ``requests_per_min`` for
    requests), starting full and refilled at ``limit / window_s`` per second
    (see :mod:`batchgen.simulator.bucket`). The simulator counts tokens its own
    way: a request is charged ``ceil(request body bytes / 4) + max_tokens``,
    final at admission (``charge_mode`` applies to the window only). The usage
    in the answers stays the real token counts.

Flex (OpenAI's ``service_tier: "flex"``): such a request's latency is
``flex_latency_factor`` times the above; while ``flex_max_in_flight`` flex requests
are in progress on its deployment, or for a seeded share ``flex_refusal_rate``, it is
refused with a 429 ``resource_unavailable`` before any limit counts it.

Prompt caching: a prefix stays cached ``prompt_cache_ttl_s`` after its last use
(:mod:`batchgen.simulator.caching`).

Latency: an answer takes ``latency_base_ms + latency_per_token_ms *
completion_tokens + jitter`` where jitter is drawn *uniformly* from
``[0, latency_jitter_ms]`` by the seeded RNG. For streams, the base + jitter is
the time to the first chunk and the per-token part is spread over the chunks.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

ChargeMode = Literal["reserve", "actual"]
LimiterKind = Literal["window", "bucket"]
LIMITERS: tuple[str, ...] = ("window", "bucket")
FAULT_KINDS: tuple[str, ...] = ("5xx", "hang", "reset", "malformed", "429")
DEFAULT_FAULT_KINDS: tuple[str, ...] = ("5xx", "hang", "reset", "malformed")
# "status:<NNN>[:<code>]": answer NNN (400-599) with the API's error body, e.g.
# "status:403" or "status:400:context_length_exceeded".
_STATUS_FAULT = re.compile(r"^status:([45]\d\d)(?::([a-z0-9_]{1,64}))?$")


def parse_status_fault(kind: str) -> tuple[int, str | None] | None:
    """``(status, code)`` of a ``"status:NNN[:code]"`` fault kind, else None."""
    match = _STATUS_FAULT.match(kind)
    return (int(match.group(1)), match.group(2)) if match else None


def is_fault_kind(kind: str) -> bool:
    """True for one of :data:`FAULT_KINDS` or a ``"status:NNN[:code]"`` kind."""
    return kind in FAULT_KINDS or parse_status_fault(kind) is not None


# Fields POST /_sim/config may change at run time.
RUNTIME_FIELDS = frozenset(
    {
        "tokens_per_min",
        "requests_per_min",
        "charge_mode",
        "limiter",
        "latency_base_ms",
        "latency_per_token_ms",
        "latency_jitter_ms",
        "fault_rate",
        "fault_kinds",
        "hang_s",
        "context_window",
        "default_max_tokens",
        "batch_turnaround_s",
        "batch_row_error_rate",
        "batch_expire",
        "batch_fail",
        "batch_enqueued_tokens_limit",
        "batch_create_delay_s",
        "batch_min_records",
        "s3_endpoint_url",
        "gcs_endpoint_url",
        "flex_latency_factor",
        "flex_max_in_flight",
        "flex_refusal_rate",
        "prompt_cache_ttl_s",
        "prompt_cache_min_tokens",
    }
)


@dataclass
class SimulatorConfig:
    """Settings of one simulator instance (all limits are per API key and model).

    ``tokens_per_min`` / ``requests_per_min``: ``None`` means unlimited (and the
    matching ``x-ratelimit-*`` headers are then omitted). Despite the names,
    the window length is ``window_s`` (60 s by default).
    """

    tokens_per_min: int | None = None
    requests_per_min: int | None = None
    charge_mode: ChargeMode = "reserve"
    limiter: LimiterKind = "window"
    latency_base_ms: float = 0.0
    latency_per_token_ms: float = 0.0
    latency_jitter_ms: float = 0.0
    fault_rate: float = 0.0
    fault_kinds: tuple[str, ...] = DEFAULT_FAULT_KINDS
    hang_s: float = 30.0
    seed: int | None = None
    window_s: float = 60.0
    context_window: int | None = None
    default_max_tokens: int = 1024
    encoding: str = "cl100k_base"
    models: tuple[str, ...] = field(default_factory=tuple)
    log_size: int = 100_000
    # The providers' batch APIs (app/simulator/batch_jobs.py): how long a job takes,
    # the share of rows that fail, whether jobs expire instead of completing, whether
    # every new job fails, and the enqueued tokens one key may hold per model.
    batch_turnaround_s: float = 2.0
    batch_row_error_rate: float = 0.0
    batch_expire: bool = False
    batch_fail: bool = False
    batch_enqueued_tokens_limit: int | None = None
    # A create is answered this long after the job exists (an answer a crash can lose).
    batch_create_delay_s: float = 0.0
    # Bedrock batch inference (app/simulator/bedrock_batches.py): the fewest records a
    # job takes, and the S3 endpoint its input and output files are read and written at
    # (a real S3-compatible server: moto's in the tests).
    batch_min_records: int = 1
    s3_endpoint_url: str | None = None
    # Vertex AI batch prediction (app/simulator/gemini_batches.py): the Cloud Storage
    # JSON API its jobs read and write (gcp-storage-emulator in the tests).
    gcs_endpoint_url: str | None = None
    # OpenAI's flex tier (app/simulator/flex.py): a request with service_tier "flex" is
    # answered this many times slower, and refused with 429 "resource unavailable" while
    # flex_max_in_flight flex calls run on its deployment (None: never busy) or, by a
    # seeded draw, for a share flex_refusal_rate of them.
    flex_latency_factor: float = 3.0
    flex_max_in_flight: int | None = None
    flex_refusal_rate: float = 0.0
    # Prompt caches (app/simulator/caching.py): a prefix stays warm this long after its
    # last use (0: no caching); an Anthropic breakpoint caches a prefix this long or more.
    prompt_cache_ttl_s: float = 300.0
    prompt_cache_min_tokens: int = 1024
    # Simulated deployments served under /d/<name>/ (app/simulator/lanes.py): name ->
    # a LaneConfig or its JSON form (their own limits and fault mode).
    deployments: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fault_kinds = tuple(self.fault_kinds)
        self.models = tuple(self.models)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` if a field is out of range."""
        for name in ("tokens_per_min", "requests_per_min", "context_window"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.charge_mode not in ("reserve", "actual"):
            raise ValueError(f"charge_mode must be 'reserve' or 'actual', got {self.charge_mode!r}")
        if self.limiter not in LIMITERS:
            raise ValueError(f"limiter must be 'window' or 'bucket', got {self.limiter!r}")
        for name in ("latency_base_ms", "latency_per_token_ms", "latency_jitter_ms", "hang_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be in [0, 1], got {self.fault_rate!r}")
        unknown = {k for k in self.fault_kinds if not is_fault_kind(k)}
        if unknown:
            raise ValueError(
                f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS} or status:NNN[:code]"
            )
        if self.fault_rate > 0 and not self.fault_kinds:
            raise ValueError("fault_rate > 0 needs at least one fault kind")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        if self.batch_create_delay_s < 0:
            raise ValueError("batch_create_delay_s must be >= 0")
        if self.batch_turnaround_s < 0 or not 0.0 <= self.batch_row_error_rate <= 1.0:
            raise ValueError("batch_turnaround_s must be >= 0, batch_row_error_rate in [0, 1]")
        limit = self.batch_enqueued_tokens_limit
        if limit is not None and (type(limit) is not int or limit < 1):
            raise ValueError("batch_enqueued_tokens_limit must be a positive integer or None")
        if self.flex_latency_factor < 1 or self.prompt_cache_ttl_s < 0:
            raise ValueError("flex_latency_factor must be >= 1, prompt_cache_ttl_s >= 0")
        if not 0.0 <= self.flex_refusal_rate <= 1.0:
            raise ValueError(f"flex_refusal_rate must be in [0, 1], got {self.flex_refusal_rate!r}")
        for name in ("flex_max_in_flight", "prompt_cache_min_tokens"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if type(self.batch_min_records) is not int or self.batch_min_records < 1:
            raise ValueError("batch_min_records must be a positive integer")
        if self.default_max_tokens < 1 or self.log_size < 1:
            raise ValueError("default_max_tokens and log_size must be >= 1")

    def updated(self, changes: dict[str, Any]) -> SimulatorConfig:
        """A validated copy with ``changes`` (only :data:`RUNTIME_FIELDS`) applied."""
        unknown = set(changes) - RUNTIME_FIELDS
        if unknown:
            raise ValueError(f"cannot change {sorted(unknown)} at run time")
        if "fault_kinds" in changes:
            changes = {**changes, "fault_kinds": tuple(changes["fault_kinds"])}
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view."""
        data = dataclasses.asdict(self)
        data["fault_kinds"] = list(self.fault_kinds)
        data["models"] = list(self.models)
        data["deployments"] = {
            name: lane.as_dict() if hasattr(lane, "as_dict") else dict(lane)
            for name, lane in self.deployments.items()
        }
        return data
