"""The global token budget: one atomic Lua call per provider call.

Window semantics: a sliding window log (``app/limits/lua/budget_reserve.lua``). A
reservation of ``prompt + max_tokens`` tokens and one request counts for
``budget_window_s + budget_guard_s`` seconds from the moment Redis granted
it, so in any window of ``budget_window_s`` seconds the tokens reserved never
exceed the model's ``tokens_per_min`` (nor requests its ``requests_per_min``),
the first minute included: there is no initial burst beyond the limit.
Models sharing a ``budget_key`` (one provider account) share one budget.

Fairness: a caller the model's budget denies joins a line (by item, ordered
by first denial); the first ``budget_held_claims`` in line (at most one limit
of tokens together) hold a claim on the tokens they asked for, and any other
reservation must leave room for the claims ahead of it. So capacity freed
while a 30k-token request waits builds up for it instead of going, 1k at a
time, to the small requests behind it.
A claim lapses ``budget_claim_ttl_s`` after its caller's last try.

The pure functions at the top are the budget maths; :class:`Budget` is the
Redis edge.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import redis

from batchgen.config import Settings
from batchgen.domain.rate_limits import RateLimitState
from batchgen.domain.settlement import charged_tokens as charged_tokens  # re-exported
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import script
from batchgen.registry import ModelSpec

MAX_JITTER_S = 1.0


def reservation_tokens(prompt_tokens_est: int, max_tokens: int) -> int:
    """What to reserve before a call: the most the provider can charge for it."""
    return prompt_tokens_est + max_tokens


def countdown_s(wait_s: float, rng: random.Random | None = None) -> float:
    """Retry countdown after a denial: the wait plus up to 10 % (≤ 1 s) of jitter,
    so workers denied together do not all come back in the same instant."""
    r = rng or random
    return wait_s + r.uniform(0.0, min(MAX_JITTER_S, 0.1 * wait_s + 0.05))


def capped_cooldown_s(retry_after_s: float, max_cooldown_s: float) -> float:
    """How long a 429 closes the budget key: what the provider asked, at most the cap
    (a probe after the cap finds out whether the account is open again)."""
    return max(0.0, min(retry_after_s, max_cooldown_s))


@dataclass(frozen=True)
class Grant:
    granted: bool
    wait_s: float = 0.0
    never: bool = False  # larger than the limit itself: can never be granted
    # Why it was denied: "cooldown", "tokens", "requests" or "tenant" (the longest wait).
    reason: str = ""


class Budget:
    """Reserve, reconcile and release against Redis (global across all workers)."""

    def __init__(self, client: redis.Redis, settings: Settings):
        self.client = client
        self.window_s = settings.budget_window_s
        self.guard_s = settings.budget_guard_s
        self.max_cooldown_s = settings.max_cooldown_s
        self.held_claims = settings.budget_held_claims
        self.claim_ttl_s = settings.budget_claim_ttl_s

    def _keys(self, spec: ModelSpec, tenant_id: int | None) -> list[str]:
        tid = tenant_id if tenant_id is not None else 0
        return [
            keys.budget_log(spec.budget_key),
            keys.budget_amounts(spec.budget_key),
            keys.tenant_log(tid),
            keys.tenant_amounts(tid),
        ]

    def reserve(
        self,
        spec: ModelSpec,
        reservation_id: str,
        tokens: int,
        *,
        tenant_id: int | None = None,
        tenant_tokens_per_min: int | None = None,
        waiter_id: str | None = None,
        now_s: float | None = None,
    ) -> Grant:
        """All or nothing: ``tokens`` and one request against the model (and tenant).

        ``waiter_id`` names the caller across its retries (the item, not the
        attempt): when denied, it keeps its place in the budget's line.
        """
        key = spec.budget_key
        granted, wait_ms, reason = script(self.client, "budget_reserve")(
            keys=[
                *self._keys(spec, tenant_id),
                keys.cooldown(key),
                keys.budget_waiters(key),
                keys.budget_waiter_tokens(key),
                keys.budget_waiters_seen(key),
            ],
            args=[
                reservation_id,
                tokens,
                spec.tokens_per_min,
                spec.requests_per_min,
                tenant_tokens_per_min or 0,
                self.window_s,
                self.guard_s,
                "" if now_s is None else repr(now_s),
                waiter_id or "",
                self.claim_ttl_s,
                self.held_claims,
            ],
        )
        if granted == 1:
            return Grant(True)
        if granted == -1:
            return Grant(False, never=True, reason="never")
        why = reason.decode() if isinstance(reason, bytes) else str(reason)
        return Grant(False, wait_s=int(wait_ms) / 1000.0, reason=why)

    def reconcile(
        self, spec: ModelSpec, reservation_id: str, tokens: int, tenant_id: int | None = None
    ) -> int:
        """Set the reservation to what the provider charged; returns the change."""
        return int(
            script(self.client, "budget_adjust")(
                keys=self._keys(spec, tenant_id), args=[reservation_id, tokens, "0"]
            )
        )

    def release(self, spec: ModelSpec, reservation_id: str, tenant_id: int | None = None) -> int:
        """Give the whole reservation back (the call never reached the provider)."""
        return int(
            script(self.client, "budget_adjust")(
                keys=self._keys(spec, tenant_id), args=[reservation_id, 0, "1"]
            )
        )

    def observe(
        self,
        spec: ModelSpec,
        state: RateLimitState,
        reservation_id: str,
        now_s: float | None = None,
        age_s: float | None = None,
    ) -> int:
        """Lower our budget when the provider reports less capacity than we think.

        The report is compared with our window as it was when its header was
        received, ``age_s`` ago (by default: from ``state.received_s``).
        """
        if state.remaining_tokens is None:
            return 0
        age = state.age_s() if age_s is None else max(0.0, age_s)
        if age >= self.window_s + self.guard_s:
            return 0  # everything it counted has left our window since
        reset_s = state.reset_tokens_s if state.reset_tokens_s is not None else self.window_s
        return int(
            script(self.client, "budget_observe")(
                keys=self._keys(spec, None)[:2],
                args=[
                    reservation_id,
                    state.remaining_tokens,
                    spec.tokens_per_min,
                    reset_s,
                    self.window_s,
                    self.guard_s,
                    "" if now_s is None else repr(now_s),
                    repr(age),
                ],
            )
        )

    def cool_down(self, spec: ModelSpec, seconds: float) -> float:
        """After a 429: deny every reservation on this budget for ``seconds``, capped at
        ``max_cooldown_s``; the longer of an existing and the new cooldown is kept, in
        one atomic step. Returns the cooldown now in force, in seconds."""
        ms = max(1, int(capped_cooldown_s(seconds, self.max_cooldown_s) * 1000))
        left_ms = script(self.client, "budget_cooldown")(
            keys=[keys.cooldown(spec.budget_key)], args=[ms]
        )
        return int(left_ms) / 1000.0

    def used(self, spec: ModelSpec, now_s: float | None = None) -> tuple[int, int]:
        """(tokens, requests) reserved in the current window, on Redis's clock, counting
        only what is still inside the window (for status and metrics)."""
        tokens, requests = script(self.client, "budget_used")(
            keys=self._keys(spec, None)[:2],
            args=[self.window_s, self.guard_s, "" if now_s is None else repr(now_s)],
        )
        return int(tokens), int(requests)
