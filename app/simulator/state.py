"""Mutable state of a running simulator: config, limiters, request log and counters.

Only touched from the server's event loop (single thread), so no locks.
The request log holds ids, sizes, token counts and timings, never text.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, deque
from collections.abc import Hashable
from typing import Any

from aiohttp import web

from batchgen.simulator.bucket import TokenBucketLimiter, own_count_charge
from batchgen.simulator.caching import PromptCache
from batchgen.simulator.faults import FaultInjector
from batchgen.simulator.flex import FlexTier
from batchgen.simulator.lanes import Lane, LaneConfig, Limiter, limiters
from batchgen.simulator.limits import Admission, SlidingWindowLimiter
from batchgen.simulator.sim_config import SimulatorConfig

LimitKey = tuple[str, str]  # (api key id, model)


def key_id(api_key: str | None) -> str:
    """A short non-secret id for an API key (``"anonymous"`` when none was sent)."""
    if not api_key:
        return "anonymous"
    return "key_" + hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:12]


class SimState:
    """Everything a simulator instance remembers."""

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        requests, tokens = self._limiters(config)
        faults = FaultInjector(config.fault_rate, config.fault_kinds, config.seed)
        self.root = Lane(None, requests, tokens, faults)
        # Simulated deployments (app/simulator/lanes.py), by name.
        self.lanes: dict[str, Lane] = {}
        self.lane_configs: dict[str, LaneConfig] = {}
        self.set_lanes(config.deployments)
        self.log: deque[dict[str, Any]] = deque(maxlen=config.log_size)
        self.models: dict[str, None] = dict.fromkeys(config.models)
        self.counters: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        # Prompt prefixes warm in the providers' caches (simulator.caching, .rich), flex
        # calls in progress (simulator.flex), and each API's last request body (for
        # tests: ``GET /_sim/last_request``; never logged).
        self.prompt_cache = PromptCache(config.prompt_cache_ttl_s, config.prompt_cache_min_tokens)
        self.flex = FlexTier(config.seed)
        self.last_request: dict[str, Any] = {}

    # -- configuration ---------------------------------------------------------
    @staticmethod
    def _limiters(config: SimulatorConfig) -> tuple[Limiter, Limiter]:
        """Fresh (requests, tokens) limiters of the configured kind."""
        return limiters(
            config.limiter, config.requests_per_min, config.tokens_per_min, config.window_s
        )

    # The root lane's parts, as the simulator's own.
    @property
    def requests(self) -> Limiter:
        return self.root.requests

    @property
    def tokens(self) -> Limiter:
        return self.root.tokens

    @property
    def faults(self) -> FaultInjector:
        return self.root.faults

    @property
    def bucket_mode(self) -> bool:
        """True when the token-bucket limiter (and its own token count) is in force."""
        return self.root.bucket_mode

    def set_lanes(self, configs: dict[str, Any]) -> None:
        """Set simulated deployments (``name -> LaneConfig`` or its JSON form), each
        fresh: new limiters, and its fault mode's time counted from now. Others stay."""
        for name, raw in configs.items():
            config = raw if isinstance(raw, LaneConfig) else LaneConfig.from_dict(raw)
            self.lane_configs[name] = config
            self.lanes[name] = Lane.of(name, config, self.config.window_s, self.config.seed)

    def lane(self, name: str | None) -> Lane | None:
        """The lane called ``name`` (None: the root lane); None when there is none."""
        return self.root if name is None else self.lanes.get(name)

    def apply_config(self, changes: dict[str, Any]) -> SimulatorConfig:
        """Change run-time settings (raises ``ValueError``); limiter history is kept,
        except that switching ``limiter`` starts fresh limiters (a full bucket or an
        empty window)."""
        new = self.config.updated(changes)
        switched = new.limiter != self.config.limiter
        self.config = new
        if switched:
            self.root.requests, self.root.tokens = self._limiters(new)
        self.requests.limit = new.requests_per_min
        self.tokens.limit = new.tokens_per_min
        self.faults.rate = new.fault_rate
        self.faults.kinds = new.fault_kinds
        self.prompt_cache.ttl_s = new.prompt_cache_ttl_s
        self.prompt_cache.min_tokens = new.prompt_cache_min_tokens
        return new

    def reset(self) -> None:
        """Clear log, counters and limiters and reseed the fault RNG (the config stays)."""
        self.requests.clear()
        self.tokens.clear()
        for lane in self.lanes.values():
            lane.requests.clear()
            lane.tokens.clear()
        self.log.clear()
        self.counters.clear()
        self.prompt_cache.clear()
        self.flex = FlexTier(self.config.seed)  # a flex call still running leaves the old one
        self.last_request.clear()
        self.max_in_flight = self.in_flight
        cfg = self.config
        self.root.faults = FaultInjector(cfg.fault_rate, cfg.fault_kinds, cfg.seed)

    # -- admission -------------------------------------------------------------
    def charge(
        self, prompt_tokens: int, body_bytes: int, max_tokens: int, lane: Lane | None = None
    ) -> int:
        """The token charge of a request: ``prompt_tokens + max_tokens`` (window), or
        the simulator's own count ``ceil(body_bytes / 4) + max_tokens`` (bucket)."""
        if (lane or self.root).bucket_mode:
            return own_count_charge(body_bytes, max_tokens)
        return prompt_tokens + max_tokens

    def admit(
        self, key: LimitKey, tokens: int, entry_id: Hashable, lane: Lane | None = None
    ) -> tuple[Admission, Admission]:
        """Check both limits of the lane (default: the root) at once; record in both
        only if both admit."""
        at = lane or self.root
        now = time.monotonic()
        req = at.requests.check(key, 1, now)
        tok = at.tokens.check(key, tokens, now)
        if req.ok and tok.ok:
            req = at.requests.try_admit(key, 1, now, entry_id)
            tok = at.tokens.try_admit(key, tokens, now, entry_id)
        elif at.bucket_mode:  # nothing taken: report the buckets as they are
            if req.ok:
                req = at.requests.check(key, 0, now)
            if tok.ok:
                tok = at.tokens.check(key, 0, now)
        else:  # nothing recorded: report what is really left
            if req.ok and at.requests.limit is not None:
                req = req._replace(remaining=req.remaining + 1)
            if tok.ok and at.tokens.limit is not None:
                tok = tok._replace(remaining=tok.remaining + tokens)
        return req, tok

    def peek(self, key: LimitKey, lane: Lane | None = None) -> tuple[Admission, Admission]:
        """The current state of both limits for ``key`` (records nothing)."""
        at = lane or self.root
        now = time.monotonic()
        return at.requests.check(key, 0, now), at.tokens.check(key, 0, now)

    def settle(
        self,
        key: LimitKey,
        entry_id: Hashable,
        prompt: int,
        delivered: int,
        lane: Lane | None = None,
    ) -> int:
        """Final token charge of an admitted request (lowered in ``"actual"`` mode)."""
        tokens = (lane or self.root).tokens
        try:
            reserved = tokens.amount_of(entry_id)
        except KeyError:  # forgotten by a /_sim/reset while the request ran
            return 0
        if self.config.charge_mode == "actual" and isinstance(tokens, SlidingWindowLimiter):
            final = min(reserved, prompt + delivered)
            tokens.adjust(key, entry_id, final)
            self.counters["tokens_admitted"] -= reserved - final
            return final
        return reserved

    # -- bookkeeping -----------------------------------------------------------
    def start(
        self,
        api: str,
        request_id: str,
        item: str | None,
        peer: str | None = None,
        deployment: str | None = None,
    ) -> dict[str, Any]:
        """A new log entry (appended now, filled in as the request goes); ``peer`` is the
        client's address, ``deployment`` the simulated deployment (lane) it came to."""
        entry: dict[str, Any] = {
            "request_id": request_id,
            "deployment": deployment,
            "item": item,
            "peer": peer,
            "api": api,
            "model": None,
            "key": None,
            "start_ts": time.time(),
            "end_ts": None,
            "status": None,
            "stream": False,
            "completed": False,
            "admitted": False,
            "fault": None,
            "finish_reason": None,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "charged_tokens": 0,
            # What the call asked of the token limit when it reached it (admitted or not).
            "requested_tokens": 0,
        }
        self.log.append(entry)
        self.counters["requests"] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return entry

    def finish(self, entry: dict[str, Any]) -> None:
        """Close a log entry: end time and counters."""
        entry["end_ts"] = time.time()
        self.in_flight -= 1
        if entry["admitted"]:
            self.counters["prompt_tokens"] += entry["prompt_tokens"]
            self.counters["completion_tokens"] += entry["completion_tokens"]
        if not entry["completed"]:
            self.counters["incomplete"] += 1

    def stats(self) -> dict[str, Any]:
        """The ``GET /_sim/stats`` document."""
        c = self.counters
        per_model: dict[str, int] = {}
        for model in self.models:
            keys = [k for k in self.tokens.known_keys() if isinstance(k, tuple) and k[1] == model]
            per_model[model] = self.tokens.max_window_sum(keys)
        windows = {
            "tokens": self.tokens.max_window_sum(),
            "requests": self.requests.max_window_sum(),
        }
        return {
            "requests": c["requests"],
            "admitted": c["admitted"],
            "rate_limited": c["rate_limited"],
            "errors": c["errors"],
            "bad_requests": c["bad_requests"],
            "incomplete": c["incomplete"],
            "faults": {k.removeprefix("fault_"): v for k, v in c.items() if k.startswith("fault_")},
            "tokens_admitted": c["tokens_admitted"],
            "prompt_tokens": c["prompt_tokens"],
            "completion_tokens": c["completion_tokens"],
            "max_tokens_in_any_window": windows["tokens"],
            "max_tokens_in_any_window_per_model": per_model,
            "max_requests_in_any_window": windows["requests"],
            "window_s": self.config.window_s,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            # Flex calls served and refused as busy (app/simulator/flex.py).
            "flex": {"admitted": c["flex_admitted"], "refused": c["flex_refused"]},
            "limiter": self.config.limiter,
            "bound": self._bound(windows),
            "deployments": {name: self._lane_stats(lane) for name, lane in self.lanes.items()},
        }

    def _lane_stats(self, lane: Lane) -> dict[str, Any]:
        """A simulated deployment's calls by outcome and its window maxima and bounds."""
        calls = [e for e in self.log if e.get("deployment") == lane.name]
        windows = {
            "tokens": lane.tokens.max_window_sum(),
            "requests": lane.requests.max_window_sum(),
        }
        return {
            "requests": len(calls),
            "admitted": sum(1 for e in calls if e["admitted"]),
            "succeeded": sum(1 for e in calls if e["status"] == 200 and e["completed"]),
            "rate_limited": sum(1 for e in calls if e["status"] == 429),
            "errors": sum(1 for e in calls if (e["status"] or 0) >= 500 or e["fault"]),
            "config": self.lane_configs[lane.name or ""].as_dict(),
            "bound": self._bound(windows, lane),
        }

    def _bound(self, windows: dict[str, int], lane: Lane | None = None) -> dict[str, Any]:
        """What the provider's limits allow against what was admitted, per limit.

        ``admitted``: the charges still in the limiter's history (all keys).
        Window: ``max_in_any_window`` must be <= ``limit``. Bucket (capacity
        ``limit``, refill ``refill_per_s``): ``max_burst`` (max over intervals
        ``[t0, t1]`` of admitted - refill * (t1 - t0), per key) must be <=
        ``limit``; ``max_in_any_window`` is then at most ``2 * limit``.
        ``respected`` is None when unlimited.
        """
        out: dict[str, Any] = {}
        at = lane or self.root
        for what, limiter in (("tokens", at.tokens), ("requests", at.requests)):
            limit = limiter.limit
            in_window = windows[what]
            doc: dict[str, Any] = {"limit": limit, "max_in_any_window": in_window}
            if isinstance(limiter, TokenBucketLimiter):
                burst = limiter.max_burst()
                doc.update(
                    capacity=limit,
                    refill_per_s=limiter.rate,
                    admitted=limiter.total(),
                    max_burst=burst,
                    respected=None if limit is None or burst is None else burst <= limit + 1e-6,
                )
            else:
                doc.update(respected=None if limit is None else in_window <= limit)
            out[what] = doc
        return out

    def entries(self, item: str | None = None) -> list[dict[str, Any]]:
        """Log entries, optionally only those of one ``x-batchgen-item``."""
        return [dict(e) for e in self.log if item is None or e["item"] == item]


STATE: web.AppKey[SimState] = web.AppKey("simulator_state", SimState)
