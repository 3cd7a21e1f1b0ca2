"""The gate in front of every provider call: a concurrency slot and the budget, in one step.

Entering is one atomic Lua script (``lua/budget_reserve.lua``): a free slot for
the model and the budget's reservation, all or nothing, so once tokens are
reserved the call starts at once (a reservation is only honest about *when*
the provider sees the tokens if nothing waits in between). Waiting for a slot
is that same script again, polled for up to ``slot_wait_s``. After the call,
:meth:`Gate.settle` is one script too (``lua/budget_settle.lua``): it frees the
slot, reconciles the reservation with what the provider reports and listens
to it: a 429 starts a cooldown, rate-limit headers (of an answer or a 429)
calibrate the budget, the learned ratio moves, the counters count.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import redis

from batchgen.config import Settings
from batchgen.domain.formats.admission import never_fits
from batchgen.domain.scheduling.call_shares import share_of
from batchgen.domain.scheduling.pools import breaker_signal
from batchgen.domain.scheduling.rate_limits import RateLimitState
from batchgen.domain.scheduling.settlement import SettleAction, SettleCounter, decide_settlement
from batchgen.errors import ProviderError, RateLimited
from batchgen.limits import counters
from batchgen.limits.budget import Budget, Grant, SettleOps, countdown_s, reservation_tokens
from batchgen.limits.call_demand import DEMAND_TTL_S, CallDemand, demand_entry, tenant_key
from batchgen.limits.concurrency import Slots
from batchgen.limits.gate_state import is_known_good
from batchgen.registry import ModelSpec

SLOT_POLL_S = 0.05
SLOT_RETRY_S = 0.5
# How long a synchronous call's claim on the next free slot lasts without a new try
# (it tries every SLOT_POLL_S): a caller that went away frees it by itself.
URGENT_CLAIM_S = 10 * SLOT_POLL_S

# Each counter a settlement names, as the field counters.incr() adds to.
_SETTLE_COUNTERS = {
    SettleCounter.COOLDOWNS: counters.COOLDOWNS,
    SettleCounter.RATE_LIMITED: counters.RATE_LIMITED,
    SettleCounter.TRANSIENT_ERRORS: counters.TRANSIENT_ERRORS,
    SettleCounter.PERMANENT_ERRORS: counters.PERMANENT_ERRORS,
}


class CallTicket(Protocol):
    """What the gate reads of the item about to be called (the store's ``Claimed``
    is one): the gate knows ids, token counts and limits, not items."""

    @property
    def item_id(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def tenant_id(self) -> int: ...
    @property
    def tenant_tokens_per_min(self) -> int | None: ...
    @property
    def prompt_tokens_est(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...


class CallAnswer(Protocol):
    """What the gate reads of a provider's answer (a ``ProviderResponse`` is one)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def rate_limits(self) -> RateLimitState: ...


def running_lease_s(spec: ModelSpec, settings: Settings) -> float:
    """How long a running item (and its concurrency slot) stays ours. A streamed call
    may take up to twice its timeout (the SDK's timeout bounds each read, the stream
    deadline is checked between chunks), so the lease covers both and a margin. A model
    with a flex route counts its flex calls' longer timeout."""
    timeout_s = spec.call_timeout_s or settings.providers.call_timeout_s
    if spec.flex is not None:
        timeout_s = max(timeout_s, spec.flex.timeout_s)
    return 2 * timeout_s + settings.worker.running_lease_margin_s


@dataclass(frozen=True)
class Pass:
    """Admitted: the call may start now. Hand it back to :meth:`Gate.settle`."""

    reservation_id: str
    tokens: int  # reserved (the prompt scaled by the learned ratio)
    prompt_tokens_est: int = 0  # our own count of the prompt (for the ratio)
    # The reservation (and the slot) were on the books before this entry: another
    # delivery of the same attempt made them. If no call follows, they are left alone.
    adopted: bool = False
    slot_adopted: bool = False
    # The deployment of the model that takes the call (the gate picked it).
    deployment: str = ""


class WaitKind(StrEnum):
    """What denied a call, which decides what a waiting item may do meanwhile."""

    SLOT = "slot"  # all concurrency slots held: they free within a call's time
    COOLDOWN = "cooldown"  # the provider said 429: a probe at the cooldown's end may pass
    TOKENS = "tokens"  # the model's tokens in the window: they free at a known time
    REQUESTS = "requests"  # the model's requests in the window
    TENANT = "tenant"  # the tenant's own tokens_per_min

    @property
    def firm(self) -> bool:
        """The wait is a lower bound: a call before it is impossible."""
        return self in (WaitKind.TOKENS, WaitKind.REQUESTS, WaitKind.TENANT)

    @property
    def releases_dispatch(self) -> bool:
        """The item waits on its own tenant, so it must not hold the model's dispatch
        window (other tenants' items could use it meanwhile)."""
        return self is WaitKind.TENANT


@dataclass(frozen=True)
class Settling:
    """One call of a pack to settle (:meth:`Gate.settle_many`): what :meth:`Gate.settle`
    takes for it."""

    admitted: Pass
    tenant_id: int
    max_tokens: int
    response: CallAnswer | None = None
    error: ProviderError | None = None
    cut_by_deadline: bool = False


@dataclass(frozen=True)
class Wait:
    wait_s: float
    reason: str
    kind: WaitKind = WaitKind.TOKENS


@dataclass(frozen=True)
class Never:
    reason: str


_KINDS = {k.value for k in WaitKind}
_REASONS = {
    WaitKind.SLOT: "no free concurrency slot",
    WaitKind.COOLDOWN: "provider cooldown after a 429",
    WaitKind.TOKENS: "token budget exhausted",
    WaitKind.REQUESTS: "request budget exhausted",
    WaitKind.TENANT: "tenant token budget exhausted",
}


def slot_holder(item_id: int, attempt: int) -> str:
    """Who holds a slot (and a reservation): one attempt of one item."""
    return f"{item_id}:{attempt}"


def free_slot(slots: Slots, spec: ModelSpec, holder: str) -> None:
    """Release ``holder``'s slot (best effort: if Redis is down, its lease ends): the
    model's, and the deployments' own, whichever holds it."""
    own = [d.slot_key for d in spec.deployments if d.slot_key != spec.name]
    with contextlib.suppress(redis.RedisError):
        if own:
            slots.release(spec.name, holder, own)
        else:
            slots.release(spec.name, holder)


class Gate:
    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        on_lost_state: Callable[[], None] | None = None,
    ):
        self.client = client
        self.settings = settings
        self.budget = Budget(client, settings)
        self.slots = Slots(client)
        self.demand = CallDemand(client)
        self.enabled = settings.budget.enabled
        # Called when the gate's state marker is missing (Redis lost it), checked on
        # the first entry and then at most every gate_state_check_s: it rebuilds the
        # state before the entry goes on (app/worker/gate_recovery.py).
        # Between two checks, the entry script itself refuses while the marker is
        # missing (Grant.state_lost): the entry then checks at once.
        self.on_lost_state = on_lost_state
        self.budget.require_state = on_lost_state is not None
        self._checked_s = -math.inf  # when the last check began (monotonic)
        self._state_lock = threading.Lock()

    def _check_state(self, now: bool = False) -> None:
        """Rebuild the gate's state if its marker is missing, on the first entry and then
        at most every ``gate_state_check_s``; ``now``: unless a check began since this
        call (an entry refused for a missing marker)."""
        if self.on_lost_state is None or not self.enabled:
            return
        # A check that began since then will do: since this call (now), or within
        # gate_state_check_s of it.
        since_s = time.monotonic() - (0.0 if now else self.settings.worker.gate_state_check_s)
        if self._checked_s >= since_s:
            return
        # One thread checks; the process's other entrants wait for it. Otherwise they
        # would pass the gate and claim items while the check reads the database, and
        # those running items would look like another process's lost state.
        with self._state_lock:
            if self._checked_s >= since_s:
                return  # checked by another thread meanwhile
            self._checked_s = time.monotonic()
            try:
                if not is_known_good(self.client):
                    self.on_lost_state()
            except redis.RedisError:
                pass  # unreachable: the entry itself will say so

    def _slot_lease_s(self, spec: ModelSpec) -> float:
        return running_lease_s(spec, self.settings)

    def _free_slot(self, spec: ModelSpec, holder: str) -> None:
        """Release a slot after a failure (best effort: if Redis is down, its lease ends):
        the model's, and the deployments' own, whichever holds it."""
        free_slot(self.slots, spec, holder)

    def enter(self, spec: ModelSpec, item: CallTicket) -> Pass | Wait | Never:
        """Take a slot and reserve tokens (one script), or say how long to wait.

        One reservation id per item and attempt, whichever message delivers it: an
        entry whose reply was lost, or whose worker died before its claim, is adopted
        by the next delivery of that attempt instead of being left on the books for a
        call that never happens. An entry that finds the reservation already held
        (``Pass.adopted``) gives back nothing if its claim then finds nothing: the
        reservation belongs to the delivery whose call is in flight.

        A synchronous call (``urgent``) first renews its tenant's demand and reads
        everyone's (:class:`CallDemand`, one more script per try): its tenant's sync
        calls may hold only the tenant's weighted share of the model's slots
        (:func:`batchgen.domain.scheduling.call_shares.share_of`), so a tenant flooding calls
        leaves the slots that free to the others' calls and batches. Other work adds
        its tenant to that demand (in the same one script) when it is denied a slot.
        """
        self._check_state()
        reservation_id = slot_holder(item.item_id, item.attempt)
        avoid = getattr(item, "avoid", None)
        if not self.enabled:  # no budget: the first deployment, unless the item avoids it
            tokens = reservation_tokens(item.prompt_tokens_est, item.max_tokens)
            names = [d.name for d in spec.deployments]
            first = next((n for n in names if n != avoid), names[0])
            return Pass(reservation_id, tokens, item.prompt_tokens_est, deployment=first)
        deadline = time.monotonic() + self.settings.worker.slot_wait_s
        lease = self._slot_lease_s(spec)
        urgent = bool(getattr(item, "urgent", False))
        weight = int(getattr(item, "tenant_weight", 1) or 1)
        entry = demand_entry(item.tenant_id, weight, item.item_id)
        share = (tenant_key(item.tenant_id, weight), 0, entry, DEMAND_TTL_S)
        rebuilt = False  # the state checked at once after a refusal for its loss
        while True:
            last_try = time.monotonic() >= deadline
            if urgent:
                demand = self.demand.read(spec.name, entry)
                slots = share_of(spec.max_concurrency, demand, item.tenant_id)
                share = (share[0], slots, entry, DEMAND_TTL_S)
            try:
                grant = self.budget.enter(
                    spec,
                    reservation_id,
                    item.prompt_tokens_est,
                    item.max_tokens,
                    tenant_id=item.tenant_id,
                    tenant_tokens_per_min=item.tenant_tokens_per_min,
                    waiter_id=str(item.item_id),  # one place in line per item, across retries
                    slot_limit=spec.max_concurrency,
                    slot_lease_s=lease,
                    jitter_u=random.random(),
                    count=True,
                    count_slot_denial=last_try,
                    urgent=urgent,
                    urgent_claim_s=URGENT_CLAIM_S,
                    share=share,
                    avoid=avoid,
                )
            except BaseException:
                # The reply may have been lost after the script ran: the slot is not
                # ours to keep now (a retry adopts the reservation and takes a slot).
                self._free_slot(spec, reservation_id)
                raise
            if grant.state_lost:  # Redis lost the gate's state: rebuilt first, then again
                self._check_state(now=not rebuilt)
                if not rebuilt:
                    rebuilt = True
                    continue
            elif not grant.slot_denied:
                break
            if last_try:
                return Wait(countdown_s(SLOT_RETRY_S), _REASONS[WaitKind.SLOT], WaitKind.SLOT)
            time.sleep(SLOT_POLL_S)
        return self._decision(spec, item, grant, reservation_id)

    def enter_many(
        self,
        spec: ModelSpec,
        tickets: Sequence[CallTicket],
        *,
        last_try: bool = False,
        slots: bool = True,
    ) -> list[Pass | Wait | Never]:
        """:meth:`enter` for each of a pack's items, in one round trip (one script
        call, each entry as if entered alone, in order) and without waiting: an item denied
        a slot gets a :class:`Wait` of kind ``SLOT`` at once, and the caller may try it
        again when a slot frees (its own calls' ending frees some). ``last_try``: a slot
        denial counts in the model's counters, as :meth:`enter`'s last try does.
        ``slots`` False: the budget only, no slot (items whose calls will run one after
        another, under a slot their pack's first item holds). No synchronous call
        travels in a pack (someone waits on it: it runs alone)."""
        if not tickets:
            return []
        if not self.enabled:
            return [self.enter(spec, ticket) for ticket in tickets]
        self._check_state()
        lease = self._slot_lease_s(spec)
        entries: list[dict[str, Any]] = []
        for item in tickets:
            weight = int(getattr(item, "tenant_weight", 1) or 1)
            demand = demand_entry(item.tenant_id, weight, item.item_id)
            entries.append(
                {
                    "reservation_id": slot_holder(item.item_id, item.attempt),
                    "prompt_tokens": item.prompt_tokens_est,
                    "rest_tokens": item.max_tokens,
                    "tenant_id": item.tenant_id,
                    "tenant_tokens_per_min": item.tenant_tokens_per_min,
                    "waiter_id": str(item.item_id),
                    "slot_limit": spec.max_concurrency if slots else 0,
                    "slot_lease_s": lease,
                    "jitter_u": random.random(),
                    "count": True,
                    "count_slot_denial": last_try,
                    "urgent_claim_s": URGENT_CLAIM_S,
                    "share": (tenant_key(item.tenant_id, weight), 0, demand, DEMAND_TTL_S),
                    "avoid": getattr(item, "avoid", None),
                }
            )
        try:
            grants = self.budget.enter_many(spec, entries)
            lost = [i for i, grant in enumerate(grants) if grant.state_lost]
            if lost:  # Redis lost the gate's state: rebuilt first, then those again
                self._check_state(now=True)
                again = self.budget.enter_many(spec, [entries[i] for i in lost])
                for i, grant in zip(lost, again, strict=True):
                    grants[i] = grant
        except BaseException:
            for entry in entries:  # replies lost: no slot is ours to keep (see enter)
                self._free_slot(spec, str(entry["reservation_id"]))
            raise
        decisions: list[Pass | Wait | Never] = []
        for item, grant, entry in zip(tickets, grants, entries, strict=True):
            if grant.slot_denied or grant.state_lost:  # still lost: tried again soon
                wait = Wait(countdown_s(SLOT_RETRY_S), _REASONS[WaitKind.SLOT], WaitKind.SLOT)
                decisions.append(wait)
            else:
                decisions.append(self._decision(spec, item, grant, str(entry["reservation_id"])))
        return decisions

    def _decision(
        self, spec: ModelSpec, item: CallTicket, grant: Grant, reservation_id: str
    ) -> Pass | Wait | Never:
        """What a grant that is no slot denial says of ``item``."""
        if grant.granted:
            return Pass(
                reservation_id,
                grant.tokens,
                item.prompt_tokens_est,
                adopted=grant.held_before,
                slot_adopted=grant.slot_held_before,
                deployment=grant.deployment,
            )
        if grant.never:
            tokens = reservation_tokens(item.prompt_tokens_est, item.max_tokens)
            why = never_fits(tokens, spec, item.tenant_tokens_per_min)
            return Never(why or f"a request of {tokens} tokens can never fit {spec.name}")
        kind = WaitKind(grant.reason) if grant.reason in _KINDS else WaitKind.TOKENS
        return Wait(grant.countdown_s, _REASONS[kind], kind)

    def settle(
        self,
        spec: ModelSpec,
        admitted: Pass,
        tenant_id: int,
        max_tokens: int,
        response: CallAnswer | None = None,
        error: ProviderError | None = None,
        cut_by_deadline: bool = False,
    ) -> None:
        """Reconcile the reservation with the outcome, listen to the provider, free the
        slot: one script. ``cut_by_deadline``: the call's time-out was its item's time
        left (:func:`batchgen.domain.scheduling.pools.breaker_signal`).

        What to do is :func:`batchgen.domain.scheduling.settlement.decide_settlement`'s decision;
        :func:`settle_ops` translates it for the script."""
        if not self.enabled:
            return
        rid = admitted.reservation_id
        try:
            ops = settle_ops(
                spec, admitted, tenant_id, max_tokens, response, error, cut_by_deadline
            )
            self.budget.settle(spec.at(admitted.deployment), rid, ops)
        except BaseException:
            self._free_slot(spec, rid)  # the script may not have run: free it anyway
            raise

    def settle_many(
        self, spec: ModelSpec, outcomes: Sequence[Settling], then: Sequence[tuple[Any, ...]] = ()
    ) -> None:
        """:meth:`settle` for each of a pack's calls, in one round trip (one script
        call, each as if settled alone; ``then``: commands after it in it, such as
        the announcement that the slots freed). On an error every slot named is freed
        (the scripts may not have run) and the error raised."""
        if not self.enabled or not outcomes:
            return
        try:
            self.budget.settle_many(
                [
                    (
                        spec.at(o.admitted.deployment),
                        o.admitted.reservation_id,
                        settle_ops(
                            spec,
                            o.admitted,
                            o.tenant_id,
                            o.max_tokens,
                            o.response,
                            o.error,
                            o.cut_by_deadline,
                        ),
                    )
                    for o in outcomes
                ],
                then,
            )
        except BaseException:
            for o in outcomes:
                self._free_slot(spec, o.admitted.reservation_id)
            raise

    def settle_unsent(
        self, spec: ModelSpec, admitted: Pass, tenant_id: int, max_tokens: int, error: ProviderError
    ) -> None:
        """The entry made no call (its claim found nothing, or it stopped before the
        call): give back what it took. An adopted reservation is another delivery's,
        so it stays; the slot is freed only if this entry took it."""
        if not self.enabled:
            return
        if not admitted.adopted:
            self.settle(spec, admitted, tenant_id, max_tokens, error=error)
        elif not admitted.slot_adopted:
            self._free_slot(spec, admitted.reservation_id)


def settle_ops(
    spec: ModelSpec,
    admitted: Pass,
    tenant_id: int,
    max_tokens: int,
    response: CallAnswer | None = None,
    error: ProviderError | None = None,
    cut_by_deadline: bool = False,
) -> SettleOps:
    """The settlement decided for this outcome, as the one settle script's operations."""
    answered = response is not None
    prompt = response.prompt_tokens if response is not None else 0
    decision = decide_settlement(
        charge_policy=spec.charge_policy,
        max_tokens=max_tokens,
        answered=answered,
        prompt_tokens=prompt,
        completion_tokens=response.completion_tokens if response is not None else 0,
        error=error,
    )
    heard: object | None = None  # an answer's headers, or a 429's
    if decision.observe_rate_limits:
        heard = response.rate_limits if response is not None else None
        if heard is None and isinstance(error, RateLimited):
            heard = error.rate_limits
    state = heard if isinstance(heard, RateLimitState) else None
    usage_known = response is not None and not getattr(response, "usage_estimated", False)
    charged = decision.charged_tokens
    return SettleOps(
        action=(decision.action.value if decision.action is not SettleAction.KEEP else ""),
        charged_tokens=charged or 0,
        charged_rest=(charged - prompt) if charged is not None else None,
        tenant_id=tenant_id,
        rate_limits=state,
        usage_prompt_tokens=prompt if usage_known else None,
        prompt_tokens_est=admitted.prompt_tokens_est if usage_known else None,
        cooldown_s=decision.cooldown_s,
        counters=tuple(_SETTLE_COUNTERS[c] for c in decision.counters),
        release_slot=True,
        breaker=breaker_signal(
            deployments=len(spec.deployments),
            answered=answered,
            error=error,
            cut_by_deadline=cut_by_deadline,
        ),
    )
