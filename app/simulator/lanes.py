"""Simulated deployments: lanes of one simulator, each with its own limits and faults.

A deployment pool (several keys, orgs, regions or Azure deployments of one model) is
simulated by one server: every route is also served under ``/d/<lane>/`` (e.g.
``/d/east/v1/chat/completions``, ``/d/east/openai/deployments/<name>/chat/completions``),
and each lane has its own limiters (tokens and requests per window, sliding window or
bucket), its own fault injector, and a fault mode that may last only ``fault_for_s``
seconds from when the lane was set (a deployment failing half its calls for a minute).
The root routes are the simulator's own lane, configured as before. The request log
names each call's lane, and ``GET /_sim/stats`` gives every lane's window maxima
against its limits.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from batchgen.simulator.bucket import TokenBucketLimiter
from batchgen.simulator.faults import FaultInjector
from batchgen.simulator.limits import SlidingWindowLimiter
from batchgen.simulator.sim_config import LIMITERS, is_fault_kind

Limiter = SlidingWindowLimiter | TokenBucketLimiter
LANE_FIELDS = frozenset(
    {"tokens_per_min", "requests_per_min", "limiter", "fault_rate", "fault_kinds", "fault_for_s"}
)


@dataclass(frozen=True)
class LaneConfig:
    """One simulated deployment's limits (None: unlimited) and fault mode: a share
    ``fault_rate`` of its calls gets one of ``fault_kinds``, for ``fault_for_s`` seconds
    from when the lane was set (None: for as long as it runs)."""

    tokens_per_min: int | None = None
    requests_per_min: int | None = None
    limiter: str = "window"
    fault_rate: float = 0.0
    fault_kinds: tuple[str, ...] = ("5xx",)
    fault_for_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fault_kinds", tuple(self.fault_kinds))
        for name in ("tokens_per_min", "requests_per_min"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.limiter not in LIMITERS:
            raise ValueError(f"limiter must be 'window' or 'bucket', got {self.limiter!r}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be in [0, 1], got {self.fault_rate!r}")
        unknown = [k for k in self.fault_kinds if not is_fault_kind(k)]
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}")
        if self.fault_for_s is not None and self.fault_for_s < 0:
            raise ValueError("fault_for_s must be >= 0")

    @classmethod
    def from_dict(cls, data: Any) -> LaneConfig:
        """From JSON (``POST /_sim/deployments``); ``ValueError`` naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("a deployment must be a JSON object")
        unknown = set(data) - LANE_FIELDS
        if unknown:
            raise ValueError(f"unknown deployment fields {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    @classmethod
    def parse(cls, text: str) -> tuple[str, LaneConfig]:
        """``NAME:tpm=..,rpm=..,limiter=..,fault_rate=..,fault_kinds=5xx+hang,fault_for_s=..``
        (the ``--deployment`` option)."""
        name, _, rest = text.partition(":")
        if not name:
            raise ValueError(f"--deployment {text!r}: expected NAME:key=value,...")
        fields: dict[str, Any] = {}
        aliases = {"tpm": "tokens_per_min", "rpm": "requests_per_min"}
        for part in filter(None, rest.split(",")):
            key, _, value = part.partition("=")
            key = aliases.get(key, key)
            if key in ("tokens_per_min", "requests_per_min"):
                fields[key] = int(value)
            elif key in ("fault_rate", "fault_for_s"):
                fields[key] = float(value)
            elif key == "fault_kinds":
                fields[key] = tuple(filter(None, value.split("+")))
            else:
                fields[key] = value
        return name, cls.from_dict(fields)

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["fault_kinds"] = list(self.fault_kinds)
        return data


def limiters(
    limiter: str, requests: int | None, tokens: int | None, window_s: float
) -> tuple[Limiter, Limiter]:
    """Fresh (requests, tokens) limiters of the kind named."""
    if limiter == "bucket":
        return TokenBucketLimiter(requests, window_s), TokenBucketLimiter(tokens, window_s)
    return SlidingWindowLimiter(requests, window_s), SlidingWindowLimiter(tokens, window_s)


class Lane:
    """A deployment's state: its limiters, its faults and when its fault mode ends
    (the root lane's are the simulator's own, configured by ``/_sim/config``)."""

    def __init__(
        self,
        name: str | None,
        requests: Limiter,
        tokens: Limiter,
        faults: FaultInjector,
        fault_until: float | None = None,
    ) -> None:
        self.name = name
        self.requests = requests
        self.tokens = tokens
        self.faults = faults
        self.fault_until = fault_until  # time.monotonic() after which no fault is drawn

    @classmethod
    def of(cls, name: str, config: LaneConfig, window_s: float, seed: int | None) -> Lane:
        requests, tokens = limiters(
            config.limiter, config.requests_per_min, config.tokens_per_min, window_s
        )
        until = None if config.fault_for_s is None else time.monotonic() + config.fault_for_s
        faults = FaultInjector(config.fault_rate, config.fault_kinds, seed)
        return cls(name, requests, tokens, faults, until)

    @property
    def bucket_mode(self) -> bool:
        return isinstance(self.tokens, TokenBucketLimiter)

    def fault(self, override: str | None) -> str | None:
        """The fault of the next call (``override``: the ``x-sim-fault`` header, which
        wins); none once the lane's fault mode has ended."""
        ended = self.fault_until is not None and time.monotonic() >= self.fault_until
        if override is None and ended:
            return None
        return self.faults.choose(override)
