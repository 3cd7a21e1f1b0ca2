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

from batchgen.simulator.config import SimulatorConfig
from batchgen.simulator.faults import FaultInjector
from batchgen.simulator.limits import Admission, SlidingWindowLimiter

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
        self.requests = SlidingWindowLimiter(config.requests_per_min, config.window_s)
        self.tokens = SlidingWindowLimiter(config.tokens_per_min, config.window_s)
        self.faults = FaultInjector(config.fault_rate, config.fault_kinds, config.seed)
        self.log: deque[dict[str, Any]] = deque(maxlen=config.log_size)
        self.models: dict[str, None] = dict.fromkeys(config.models)
        self.counters: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0

    # -- configuration ---------------------------------------------------------
    def apply_config(self, changes: dict[str, Any]) -> SimulatorConfig:
        """Change run-time settings (raises ``ValueError``); limiter history is kept."""
        new = self.config.updated(changes)
        self.config = new
        self.requests.limit = new.requests_per_min
        self.tokens.limit = new.tokens_per_min
        self.faults.rate = new.fault_rate
        self.faults.kinds = new.fault_kinds
        return new

    def reset(self) -> None:
        """Clear log, counters and limiters and reseed the fault RNG (the config stays)."""
        self.requests.clear()
        self.tokens.clear()
        self.log.clear()
        self.counters.clear()
        self.max_in_flight = self.in_flight
        cfg = self.config
        self.faults = FaultInjector(cfg.fault_rate, cfg.fault_kinds, cfg.seed)

    # -- admission -------------------------------------------------------------
    def admit(self, key: LimitKey, tokens: int, entry_id: Hashable) -> tuple[Admission, Admission]:
        """Check both limits at once; record in both only if both admit."""
        now = time.monotonic()
        req = self.requests.check(key, 1, now)
        tok = self.tokens.check(key, tokens, now)
        if req.ok and tok.ok:
            req = self.requests.try_admit(key, 1, now, entry_id)
            tok = self.tokens.try_admit(key, tokens, now, entry_id)
        else:  # nothing recorded: report what is really left
            if req.ok and self.requests.limit is not None:
                req = req._replace(remaining=req.remaining + 1)
            if tok.ok and self.tokens.limit is not None:
                tok = tok._replace(remaining=tok.remaining + tokens)
        return req, tok

    def peek(self, key: LimitKey) -> tuple[Admission, Admission]:
        """The current state of both limits for ``key`` (records nothing)."""
        now = time.monotonic()
        return self.requests.check(key, 0, now), self.tokens.check(key, 0, now)

    def settle(self, key: LimitKey, entry_id: Hashable, prompt: int, delivered: int) -> int:
        """Final token charge of an admitted request (lowered in ``"actual"`` mode)."""
        try:
            reserved = self.tokens.amount_of(entry_id)
        except KeyError:  # forgotten by a /_sim/reset while the request ran
            return 0
        if self.config.charge_mode == "actual":
            final = min(reserved, prompt + delivered)
            self.tokens.adjust(key, entry_id, final)
            self.counters["tokens_admitted"] -= reserved - final
            return final
        return reserved

    # -- bookkeeping -----------------------------------------------------------
    def start(self, api: str, request_id: str, item: str | None) -> dict[str, Any]:
        """A new log entry (appended now, filled in as the request goes)."""
        entry: dict[str, Any] = {
            "request_id": request_id,
            "item": item,
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
            "max_tokens_in_any_window": self.tokens.max_window_sum(),
            "max_tokens_in_any_window_per_model": per_model,
            "max_requests_in_any_window": self.requests.max_window_sum(),
            "window_s": self.config.window_s,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
        }

    def entries(self, item: str | None = None) -> list[dict[str, Any]]:
        """Log entries, optionally only those of one ``x-batchgen-item``."""
        return [dict(e) for e in self.log if item is None or e["item"] == item]


STATE: web.AppKey[SimState] = web.AppKey("simulator_state", SimState)
