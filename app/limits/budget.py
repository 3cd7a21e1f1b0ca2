"""The global token budget, shaped like the provider's limiter: one atomic Lua call
to enter the gate, one to settle.

Two shapes, per model (the registry's ``limit_shape``; models sharing a
``budget_key``, one provider account, share one budget and declare one shape):

``window`` (the default): a sliding window log. A reservation of its tokens
and one request counts for ``budget_window_s + budget_guard_s`` seconds from
the moment Redis granted it, so in any window of ``budget_window_s`` seconds
the tokens reserved never exceed the model's ``tokens_per_min`` (nor requests
its ``requests_per_min``), the first minute included: there is no initial
burst beyond the limit. It never exceeds any provider's per-minute limiter,
hence the default for a server whose limiter is unknown.

``bucket``: a token bucket like OpenAI's and Anthropic's: capacity
``tokens_per_min``, refilled continuously at ``tokens_per_min /
budget_window_s`` per second (the same for requests), starting full. Over any
``d`` seconds it grants at most ``capacity + rate * d``, which is what such a
provider admits: capacity freed by a call comes back a little every second,
not in one piece a minute later. Reconcile refunds what was reserved but not
charged (the prompt part stays as reserved, since the provider's limiter
counted it its own way at admission); release refunds everything.

Both live on Redis's clock, atomic and global across workers
(``lua/budget_reserve.lua``, ``lua/budget_settle.lua``); the arithmetic and
its pure twins are in :mod:`batchgen.domain.scheduling.rate_limits`.

The provider's headers (``x-ratelimit-remaining-*``,
``anthropic-ratelimit-*-remaining``, on answers and on 429s) calibrate the
budget both ways. Window: less than we believe is charged as an observation
that ages out at the provider's reset; more takes our observations back
(never a reservation: the window has no other way to know the provider forgot
it). Bucket: the level is set to what the provider reported, aged by the
refill since the call the header belongs to, minus what we granted since.

Learned ratio: the prompt part of a reservation is ``ceil(ratio *
prompt_tokens_est)`` with one ratio per model kept in Redis, an exponentially
weighted mean of the provider's count over ours (formula and samples:
:mod:`batchgen.domain.scheduling.rate_limits`), so reservations converge on the
provider's own count (OpenAI's limiter counts about four bytes a token,
~26 % more than tiktoken for English prose). Before a model's first sample the
ratio is ``budget_ratio_start`` (1.3); the first sample replaces it.

Fairness: a caller the model's budget denies joins a line (by item, ordered
by first denial); the first ``budget_held_claims`` in line (at most one limit
of tokens together) hold a claim on the tokens they asked for, and any other
reservation must leave room for the claims ahead of it, in either shape. So
capacity freed while a 30k-token request waits builds up for it instead of
going, 1k at a time, to the small requests behind it. A claim lapses
``budget_claim_ttl_s`` after its caller's last try.

The pure functions at the top are the budget maths; :class:`Budget` is the
Redis edge.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from batchgen.config import Settings
from batchgen.domain.scheduling.call_reserve import reserve_of
from batchgen.domain.scheduling.rate_limits import (
    BUCKET,
    RateLimitState,
    scaled_prompt_tokens,
    shape_evidence,
)
from batchgen.domain.scheduling.settlement import charged_tokens as charged_tokens  # re-exported
from batchgen.limits import counters
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import script, scripts_at_once
from batchgen.registry import Deployment, LimitShape, ModelSpec, shape_arg

MAX_JITTER_S = 1.0


def reservation_tokens(
    prompt_tokens_est: int, max_tokens: int, ratio: float = 1.0, limit: int | None = None
) -> int:
    """What to reserve before a call: the most the provider can charge for it, the
    prompt in the provider's count (our estimate times the learned ``ratio``), at
    most ``limit``."""
    tokens = scaled_prompt_tokens(prompt_tokens_est, ratio) + max_tokens
    return tokens if limit is None else min(limit, tokens)


def jittered_s(wait_s: float, u: float) -> float:
    """``wait_s`` plus ``u`` (in [0, 1)) of the jitter span: 10 % of the wait plus
    50 ms, at most 1 s (``budget_reserve.lua`` computes the same)."""
    return wait_s + u * min(MAX_JITTER_S, 0.1 * wait_s + 0.05)


def countdown_s(wait_s: float, rng: random.Random | None = None) -> float:
    """Retry countdown after a denial: the wait plus up to 10 % (≤ 1 s) of jitter,
    so workers denied together do not all come back in the same instant."""
    r = rng or random
    return jittered_s(wait_s, r.random())


def capped_cooldown_s(retry_after_s: float, max_cooldown_s: float) -> float:
    """How long a 429 closes the budget key: what the provider asked, at most the cap
    (a probe after the cap finds out whether the account is open again)."""
    return max(0.0, min(retry_after_s, max_cooldown_s))


@dataclass(frozen=True)
class Grant:
    granted: bool
    wait_s: float = 0.0
    never: bool = False  # larger than the limit itself: can never be granted
    # Why it was denied: "cooldown", "tokens", "requests" or "tenant" (the longest
    # wait), "slot" when no concurrency slot was free, "share" when the sync call's
    # tenant holds its share of the slots, or "state" when the gate's state marker is
    # missing (Budget.require_state).
    reason: str = ""
    # Granted: the tokens reserved (the ratio applied), of them the prompt part.
    tokens: int = 0
    prompt_part: int = 0
    # Denied: wait_s plus the jitter the caller asked for (what the counters added).
    countdown_s: float = 0.0
    # Granted: the reservation (and the slot) were held under this id before the call
    # (an earlier entry of the same attempt); it is not the caller's to give back.
    held_before: bool = False
    slot_held_before: bool = False
    # Granted: the deployment it was granted on (its name).
    deployment: str = ""

    @property
    def slot_denied(self) -> bool:
        return self.reason in ("slot", "share")

    @property
    def state_lost(self) -> bool:
        """Refused: the gate's state marker is missing (Redis lost budgets and slots)."""
        return self.reason == "state"


@dataclass(frozen=True)
class SettleOps:
    """Everything one settlement does, in one script call (``budget_settle.lua``)."""

    # "reconcile", "release" or "" (keep the reservation as it is).
    action: str = ""
    # Reconcile: the tokens the provider charged, by its usage (the window's amount).
    charged_tokens: int = 0
    # Reconcile: the part of the charge that is not the prompt (max_tokens or the
    # output); a bucket adds it to the prompt part as reserved. None: charged_tokens.
    charged_rest: int | None = None
    tenant_id: int | None = None
    # The answer's (or the 429's) rate-limit headers.
    rate_limits: RateLimitState | None = None
    # The answer's usage and our estimate of its prompt, for the ratio.
    usage_prompt_tokens: int | None = None
    prompt_tokens_est: int | None = None
    cooldown_s: float | None = None
    counters: tuple[str, ...] = ()
    release_slot: bool = False
    # The deployment's circuit breaker: "ok" (an answer), "fail" (a failure that points
    # at the deployment, app/domain/scheduling/pools.py) or "" (leave it).
    breaker: str = ""


@dataclass(frozen=True)
class Settled:
    """What a settlement changed."""

    delta: int = 0  # of the reservation's tokens (negative: refunded)
    observed: int = 0  # tokens the headers added to our count (negative: given back)
    cooldown_s: float = 0.0  # the cooldown now in force, when one was asked
    ratio: float = 1.0  # the model's learned ratio after it
    tripped_s: float = 0.0  # the breaker opened for this long (0: it did not)


def _arg(value: float | int | None) -> str:
    return "" if value is None else repr(value)


class Budget:
    """Reserve, reconcile and release against Redis (global across all workers)."""

    def __init__(self, client: redis.Redis, settings: Settings):
        self.client = client
        self.window_s = settings.budget.window_s
        self.guard_s = settings.budget.guard_s
        self.max_cooldown_s = settings.budget.max_cooldown_s
        self.held_claims = settings.budget.held_claims
        self.claim_ttl_s = settings.budget.claim_ttl_s
        self.ratio_weight = settings.budget.ratio_weight
        self.ratio_min = min(settings.budget.ratio_min, settings.budget.ratio_max)
        self.ratio_max = max(settings.budget.ratio_min, settings.budget.ratio_max)
        self.ratio_min_calls = settings.budget.ratio_min_calls
        # Learning off: reservations use our own count from the start.
        self.ratio_start = settings.budget.ratio_start if self.ratio_weight > 0 else 1.0
        self.send_spread_s = settings.budget.send_spread_s
        self.shape_samples = settings.budget.shape_samples
        self.breaker_failures = settings.providers.breaker_failures
        self.breaker_window_s = settings.providers.breaker_window_s
        self.breaker_cooldown_s = settings.providers.breaker_cooldown_s
        self.call_reserved_slots = settings.calls.reserved_slots
        self.call_reserve_recent_s = settings.calls.reserve_recent_s
        # Refuse entries while the gate's state marker is missing (Grant.state_lost): set
        # by a gate that rebuilds lost state (app/worker/gate_recovery.py).
        self.require_state = False

    @property
    def span_s(self) -> float:
        return self.window_s + self.guard_s

    def _keys(self, budget_key: str, tenant_id: int | None) -> list[str]:
        tid = tenant_id if tenant_id is not None else 0
        return [
            keys.budget_log(budget_key),
            keys.budget_amounts(budget_key),
            keys.tenant_log(tid),
            keys.tenant_amounts(tid),
        ]

    @staticmethod
    def _deployment_keys(d: Deployment) -> list[str]:
        key = d.budget_key
        return [
            keys.budget_log(key),
            keys.budget_amounts(key),
            keys.cooldown(key),
            keys.budget_waiters(key),
            keys.budget_waiter_tokens(key),
            keys.budget_waiters_seen(key),
            keys.budget_meta(key),
            keys.budget_bucket(key),
            keys.budget_ratio(key),
            keys.slots(d.slot_key),
            keys.budget_shape(key),
        ]

    # --- entering ----------------------------------------------------------------------

    def enter(
        self,
        spec: ModelSpec,
        reservation_id: str,
        prompt_tokens: int,
        rest_tokens: int,
        **options: Any,
    ) -> Grant:
        """One script: a slot and the budget's reservation, all or nothing (the options:
        :meth:`_enter_call`)."""
        keys_, args = self._enter_call(spec, reservation_id, prompt_tokens, rest_tokens, **options)
        return self._grant_of(spec, script(self.client, "budget_reserve")(keys=keys_, args=args))

    def enter_many(self, spec: ModelSpec, entries: Sequence[Mapping[str, Any]]) -> list[Grant]:
        """:meth:`enter` for each of ``entries`` (its arguments by name), in order, in
        one script call (a pack's items: each entry reads its keys and arguments exactly
        as if entered alone; :func:`~batchgen.limits.backend.scripts_at_once`)."""
        calls = [self._enter_call(spec, **entry) for entry in entries]
        replies = scripts_at_once(self.client, "budget_reserve", calls)
        return [self._grant_of(spec, reply) for reply in replies]

    def _enter_call(
        self,
        spec: ModelSpec,
        reservation_id: str,
        prompt_tokens: int,
        rest_tokens: int,
        *,
        tenant_id: int | None = None,
        tenant_tokens_per_min: int | None = None,
        waiter_id: str | None = None,
        slot_limit: int = 0,
        slot_lease_s: float = 0.0,
        jitter_u: float = 0.0,
        count: bool = False,
        count_slot_denial: bool = False,
        urgent: bool = False,
        urgent_claim_s: float = 0.5,
        share: tuple[str, int, str, float] | None = None,
        avoid: str | None = None,
        now_s: float | None = None,
    ) -> tuple[list[str], list[Any]]:
        """The keys and arguments of :meth:`enter`'s script.

        One script: a slot (``slot_limit`` > 0: the model's, of all its deployments)
        and ``prompt_tokens`` (scaled by the learned ratio) + ``rest_tokens`` and one
        request, on one of the model's deployments (and against the tenant), all or
        nothing. The deployment is the one :func:`batchgen.domain.scheduling.pools.pick` prefers
        among those with room (``avoid``: the one the item's last call failed on, last);
        :attr:`Grant.deployment` names it. ``waiter_id`` names the caller across its
        retries (the item, not the attempt): when denied, it keeps its place in a
        budget's line. ``count``: add denials and waits (and, with
        ``count_slot_denial``, a slot denial) to the model's counters. ``urgent`` (a
        synchronous call): denied a slot, it claims the next one for ``urgent_claim_s``
        (renewed by each try). ``share`` (:mod:`batchgen.limits.call_demand`): the
        caller's tenant key, its tenant's share of the slots (0: no cap; a sync call's
        tenant holds no more, denied with reason ``share``), and its demand entry with
        its ttl (added when denied a slot, so sync calls' shares count this tenant).
        While an urgent caller entered within ``call_reserve_recent_s``, other work
        leaves the calls' reserve of the slots (``call_reserved_slots``;
        :mod:`batchgen.domain.scheduling.call_reserve`) free for the next call."""
        tenant_key, share_slots, demand_entry, demand_ttl_s = share or ("", 0, "", 0.0)
        pool = spec.deployments
        tid = tenant_id if tenant_id is not None else 0
        pool_keys: list[str] = []
        pool_args: list[str | int] = []
        for d in pool:
            pool_keys += self._deployment_keys(d)
            pool_args += [
                d.tokens_per_min,
                d.requests_per_min,
                shape_arg(d.limit_shape),
                d.max_concurrency if slot_limit > 0 else 0,
                "1" if avoid is not None and d.name == avoid else "0",
            ]
        return (
            [
                keys.tenant_log(tid),
                keys.tenant_amounts(tid),
                keys.counters(spec.name),
                keys.slot_callers(spec.name),
                keys.slot_tenants(spec.name),
                keys.call_demand(spec.name),
                keys.slots(spec.name),
                *pool_keys,
                # Last, read from the end: the calls' reserve, the gate's state marker.
                keys.calls_seen(spec.name),
                keys.gate_state(),
            ],
            [
                reservation_id,
                max(0, prompt_tokens),
                max(0, rest_tokens),
                tenant_tokens_per_min or 0,
                self.window_s,
                self.guard_s,
                _arg(now_s),
                waiter_id or "",
                self.claim_ttl_s,
                self.held_claims,
                spec.name,
                slot_limit,
                slot_lease_s,
                repr(jitter_u),
                (2 if count_slot_denial else 1) if count else 0,
                counters.SLOT_DENIALS,
                counters.BUDGET_DENIALS,
                counters.BUDGET_WAIT_S,
                "1" if urgent else "0",
                urgent_claim_s,
                self.ratio_start,
                tenant_key,
                share_slots,
                demand_entry,
                demand_ttl_s,
                len(pool),
                *pool_args,
                # Last, apart from the rest (read from the end): the calls' reserve, and
                # whether the gate's state marker must be there.
                reserve_of(slot_limit, self.call_reserved_slots) if slot_limit > 0 else 0,
                self.call_reserve_recent_s,
                "1" if self.require_state else "0",
            ],
        )

    @staticmethod
    def _grant_of(spec: ModelSpec, reply: Any) -> Grant:
        """:meth:`enter`'s script's reply, read."""
        pool = spec.deployments
        status, wait_ms, reason, tokens, part, countdown = reply[:6]
        why = reason.decode() if isinstance(reason, bytes) else str(reason)
        if status == 1:
            held = int(reply[6]) if len(reply) > 6 else 0
            return Grant(
                True,
                tokens=int(tokens),
                prompt_part=int(part),
                held_before=bool(held & 1),
                slot_held_before=bool(held & 2),
                deployment=pool[int(reply[7]) - 1].name,
            )
        if status == -1:
            return Grant(False, never=True, reason="never")
        if status == 2:
            return Grant(False, reason=why if why == "share" else "slot")
        if status == 3:
            return Grant(False, reason="state")
        wait_s = int(wait_ms) / 1000.0
        text = countdown.decode() if isinstance(countdown, bytes) else str(countdown)
        return Grant(False, wait_s=wait_s, reason=why, countdown_s=float(text or wait_s))

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
        prompt_tokens: int = 0,
    ) -> Grant:
        """All or nothing: ``tokens`` and one request against the model (and tenant),
        no slot, nothing counted. ``prompt_tokens`` of the ``tokens`` are our estimate
        of the prompt, which the learned ratio scales (0: reserve ``tokens`` as they are).
        """
        prompt = max(0, min(prompt_tokens, tokens))
        return self.enter(
            spec,
            reservation_id,
            prompt,
            tokens - prompt,
            tenant_id=tenant_id,
            tenant_tokens_per_min=tenant_tokens_per_min,
            waiter_id=waiter_id,
            now_s=now_s,
        )

    # --- settling ----------------------------------------------------------------------

    def settle(
        self,
        spec: ModelSpec,
        reservation_id: str,
        ops: SettleOps,
        *,
        now_s: float | None = None,
        age_s: float | None = None,
    ) -> Settled:
        """One script: everything ``ops`` says (see :class:`SettleOps`).

        Headers are compared with our budget as it was when they were received,
        ``age_s`` ago (by default: from ``state.received_s``); a bucket reads them
        against the time its reservation was granted."""
        keys_, args = self._settle_call(spec, reservation_id, ops, now_s=now_s, age_s=age_s)
        return self._settled_of(script(self.client, "budget_settle")(keys=keys_, args=args))

    def settle_many(
        self,
        settlements: Sequence[tuple[ModelSpec, str, SettleOps]],
        then: Sequence[tuple[Any, ...]] = (),
    ) -> list[Settled]:
        """:meth:`settle` for each (spec, reservation id, ops), in order, in one script
        call (a pack's calls, each settled as if alone), ``then`` the commands after it
        in the same round trip."""
        calls = [self._settle_call(spec, rid, ops) for spec, rid, ops in settlements]
        replies = scripts_at_once(self.client, "budget_settle", calls, then)
        return [self._settled_of(reply) for reply in replies]

    def _settle_call(
        self,
        spec: ModelSpec,
        reservation_id: str,
        ops: SettleOps,
        *,
        now_s: float | None = None,
        age_s: float | None = None,
    ) -> tuple[list[str], list[Any]]:
        """The keys and arguments of :meth:`settle`'s script."""
        state = ops.rate_limits
        remaining_tokens = remaining_requests = reset_s = None
        age = 0.0
        if state is not None and state.reported:
            age = state.age_s() if age_s is None else max(0.0, age_s)
            remaining_tokens, remaining_requests = state.remaining_tokens, state.remaining_requests
            reset_s = state.reset_tokens_s
        cooldown_ms = 0
        if ops.cooldown_s is not None:
            capped = capped_cooldown_s(ops.cooldown_s, self.max_cooldown_s)
            cooldown_ms = max(1, int(capped * 1000))
        (d,) = spec.deployments  # one deployment: the model's own, or a view (spec.at)
        key = d.budget_key
        # A shape the registry leaves unset is learned from the reset headers.
        evidence = shape_evidence(state, self.window_s) if d.limit_shape is None else None
        return (
            [
                *self._keys(key, ops.tenant_id),
                keys.budget_meta(key),
                keys.budget_bucket(key),
                keys.budget_ratio(key),
                keys.cooldown(key),
                keys.slots(d.slot_key),
                keys.counters(spec.name),
                keys.slots(spec.name),
                keys.breaker(key),
                keys.slot_tenants(spec.name),
                keys.budget_shape(key),
            ],
            [
                reservation_id,
                shape_arg(d.limit_shape),
                ops.action,
                ops.charged_tokens,
                _arg(ops.charged_rest),
                spec.tokens_per_min,
                spec.requests_per_min,
                self.window_s,
                self.guard_s,
                _arg(now_s),
                _arg(remaining_tokens),
                _arg(remaining_requests),
                _arg(reset_s),
                repr(age),
                spec.name,
                _arg(ops.usage_prompt_tokens),
                _arg(ops.prompt_tokens_est),
                self.ratio_weight,
                self.ratio_min,
                self.ratio_max,
                self.ratio_min_calls,
                cooldown_ms,
                ",".join(ops.counters),
                "1" if ops.release_slot else "0",
                self.ratio_start,
                self.send_spread_s,
                ops.breaker,
                self.breaker_failures,
                self.breaker_window_s,
                int(self.breaker_cooldown_s * 1000),
                int(self.max_cooldown_s * 1000),
                evidence or "",
                self.shape_samples,
            ],
        )

    @staticmethod
    def _settled_of(reply: Any) -> Settled:
        """:meth:`settle`'s script's reply, read."""
        delta, observed, left_ms, ratio, tripped_ms = reply
        text = ratio.decode() if isinstance(ratio, bytes) else str(ratio)
        return Settled(
            int(delta), int(observed), int(left_ms) / 1000.0, float(text), int(tripped_ms) / 1000.0
        )

    def reconcile(
        self,
        spec: ModelSpec,
        reservation_id: str,
        tokens: int,
        tenant_id: int | None = None,
        *,
        now_s: float | None = None,
    ) -> int:
        """Set the reservation to what the provider charged; returns the change (a
        bucket gets a refund back, or gives up an extra charge)."""
        ops = SettleOps("reconcile", charged_tokens=tokens, tenant_id=tenant_id)
        return self.settle(spec, reservation_id, ops, now_s=now_s).delta

    def release(
        self,
        spec: ModelSpec,
        reservation_id: str,
        tenant_id: int | None = None,
        *,
        now_s: float | None = None,
    ) -> int:
        """Give the whole reservation back (the call never reached the provider); a
        bucket gets its tokens and its request back."""
        ops = SettleOps("release", tenant_id=tenant_id)
        return self.settle(spec, reservation_id, ops, now_s=now_s).delta

    def observe(
        self,
        spec: ModelSpec,
        state: RateLimitState,
        reservation_id: str,
        now_s: float | None = None,
        age_s: float | None = None,
    ) -> int:
        """Calibrate our budget to what the provider reports: the tokens this added to
        our count (negative: the budget was raised).

        Window: the report is compared with our window as it was when its header was
        received, ``age_s`` ago (by default: from ``state.received_s``). Bucket: with
        the call granted as ``reservation_id`` (the header's answer).
        """
        if not state.reported:
            return 0
        age = state.age_s() if age_s is None else max(0.0, age_s)
        if age >= self.span_s:
            return 0  # everything it counted has left our window since
        ops = SettleOps(rate_limits=state)
        return self.settle(spec, reservation_id, ops, now_s=now_s, age_s=age).observed

    def cool_down(self, spec: ModelSpec, seconds: float) -> float:
        """After a 429: deny every reservation on this budget for ``seconds``, capped at
        ``max_cooldown_s``; the longer of an existing and the new cooldown is kept, in
        one atomic step. Returns the cooldown now in force, in seconds."""
        return self.settle(spec, "", SettleOps(cooldown_s=seconds)).cooldown_s

    def used(self, spec: ModelSpec, now_s: float | None = None) -> tuple[int, int]:
        """(tokens, requests) in use, on Redis's clock (for status and metrics), summed
        over the model's deployments. Window: reserved in the current window (only what
        is still inside it). Bucket: what is missing from a full bucket (capacity minus
        level)."""
        tokens = requests = 0
        for d in spec.deployments:
            key = d.budget_key
            t, r = script(self.client, "budget_used")(
                keys=[
                    keys.budget_log(key),
                    keys.budget_amounts(key),
                    keys.budget_bucket(key),
                    keys.budget_shape(key),
                ],
                args=[
                    self.window_s,
                    self.guard_s,
                    _arg(now_s),
                    shape_arg(d.limit_shape),
                    d.tokens_per_min,
                    d.requests_per_min,
                ],
            )
            tokens, requests = tokens + int(t), requests + int(r)
        return tokens, requests

    def shape(self, spec: ModelSpec) -> LimitShape:
        """The shape the model's (first deployment's) budget is kept in now: the
        registry's, or the one learned from the provider's headers."""
        d = spec.deployments[0]
        if d.limit_shape is not None:
            return d.limit_shape
        learned = self.client.hget(keys.budget_shape(d.budget_key), "shape")
        text = learned.decode() if isinstance(learned, bytes) else learned
        return (
            LimitShape(text)
            if text in (LimitShape.WINDOW, LimitShape.BUCKET)
            else LimitShape(BUCKET)
        )

    def ratio(self, spec: ModelSpec) -> float:
        """The model's learned ratio of the provider's prompt count to ours (before the
        first sample: ``budget_ratio_start``)."""
        value = self.client.hget(keys.budget_ratio(spec.deployments[0].budget_key), spec.name)
        return float(value) if value is not None else self.ratio_start


__all__ = [
    "Budget",
    "Grant",
    "LimitShape",
    "SettleOps",
    "Settled",
    "capped_cooldown_s",
    "charged_tokens",
    "countdown_s",
    "jittered_s",
    "reservation_tokens",
]
