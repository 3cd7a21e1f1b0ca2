"""Synchronous calls (``POST /v1/chat/completions``, ``/v1/messages``), run in the
process their caller is connected to.

A call is refused at once when it cannot start in time (the fail-fast rule), else
stored as a one-item batch of priority ``call`` and run here in a thread of its own,
as a worker runs an item (the same gate, claim, recording and ledger), with no broker
in between: a wait for a slot or the budget is slept here as a worker's retry would
be, and an attempt that failed and may be retried is released here again once its
backoff has passed. Its caller waits in :mod:`batchgen.worker.call_answers`.

A streamed call hands its provider's chunks to its caller as they arrive
(:mod:`batchgen.worker.relay`); once the caller has part of an answer, an attempt
that fails is not retried (no retry could finish that answer). If this process
dies, the caller is gone with it: the sweep cancels the call (its caller's presence
in Redis lapses) instead of handing it to a worker.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from batchgen.config import Settings, current_scope, get_settings
from batchgen.domain.formats import call_rules
from batchgen.domain.scheduling import call_shares
from batchgen.errors import Overloaded, OverShare, Unavailable
from batchgen.limits import liveness
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import REDIS_DOWN, get_redis
from batchgen.limits.call_demand import CallDemand, demand_entry
from batchgen.limits.gate import Gate, running_lease_s
from batchgen.registry import ModelSpec, get_registry
from batchgen.store import call_rows, db, items, tenants
from batchgen.store.call_rows import CallWaiter
from batchgen.store.db import session_scope
from batchgen.store.schema import Tenant
from batchgen.worker import money_holds, publish
from batchgen.worker.cancellation import CancelWatcher, cancel_batch
from batchgen.worker.execution import run_item
from batchgen.worker.gate_recovery import checked_gate
from batchgen.worker.packs import CallPace
from batchgen.worker.relay import ChunkRelay, Wake

log = logging.getLogger(__name__)

_waiters: dict[str, CallWaiter] = {}
_waiters_lock = threading.Lock()


def call_waiter() -> CallWaiter:
    """The process's listener for the ends of calls (one per database), on a direct
    connection (BATCHGEN_DATABASE_DIRECT_URL): LISTEN needs a session of its own."""
    url = get_settings().direct_sqlalchemy_url
    with _waiters_lock:
        if url not in _waiters:
            _waiters[url] = CallWaiter(url.replace("postgresql+psycopg://", "postgresql://", 1))
        return _waiters[url]


def close_call_waiters() -> None:
    """Stop the process's listeners for the ends of calls (before its database stops)."""
    with _waiters_lock:
        waiters = list(_waiters.values())
        _waiters.clear()
    for waiter in waiters:
        waiter.close()


def redis_unavailable() -> Unavailable:
    return Unavailable(
        "redis_unavailable",
        "Redis is unavailable; retry later",
        retry_after_s=get_settings().api.unavailable_retry_after_s,
    )


def _model_now(spec: ModelSpec) -> tuple[float, dict[int, call_shares.Demand]]:
    """In one round trip: the provider's cooldown on the model's budget (0 when none;
    for a model of several deployments, the shortest of theirs) and every tenant's sync
    calls on it ({} when Redis cannot say: the gate will say so anyway). Redis
    unreachable (refused, or silent past the client's socket timeout):
    :class:`Unavailable` now, before the call is stored, rather than a call that cannot
    pass the gate."""
    cooldowns = [keys.cooldown(d.budget_key) for d in spec.deployments]
    try:
        demand, lefts_ms = CallDemand(get_redis()).read_with_ttls(spec.name, cooldowns)
    except REDIS_DOWN:
        raise redis_unavailable() from None
    left_s = min(max(0.0, ms / 1000.0) if ms is not None else 0.0 for ms in lefts_ms)
    return left_s, demand or {}


@dataclass(frozen=True)
class PendingCall:
    """A call stored and released; :mod:`batchgen.worker.call_answers` waits for its end."""

    stored: call_rows.StoredCall
    tenant: str | Tenant
    deadline_mono_s: float
    woken: threading.Event
    # What stopped the run in this process before the item ended (Redis went away):
    # the waiter answers it at once instead of waiting out the deadline.
    failures: list[BaseException] = dataclasses.field(default_factory=list)
    # A streamed call's chunks as they arrive (None: the caller waits for the end).
    relay: ChunkRelay | None = None
    # The answer of record, once this process's run recorded it: its caller has it
    # without reading it back.
    answer: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Set once this process runs the call no more (None: it was not run here, as a
    # replay's): until then, its end is heard from the run, not read.
    run_ended: threading.Event | None = None

    def running_here(self) -> bool:
        """Whether this process's run of the call is still under way."""
        return self.run_ended is not None and not self.run_ended.is_set()


# How long this process's calls took, per model (the fail-fast rule's round of calls).
pace = CallPace()


def refuse_early(
    spec: ModelSpec, tenant: str | Tenant, deadline_s: float, read_budget: bool = True
) -> bool:
    """The fail-fast rule, before anything is stored: :class:`Overloaded` (503) when the
    model's calls ahead need longer than ``deadline_s``; :class:`OverShare` (429) when
    the tenant's own open calls, run at its share of the model's slots, do. Returns
    whether the tenant has a dollar budget (read in the same statement: without one,
    the call has nothing to reserve), or False unless ``read_budget`` (the request's
    key already said)."""
    if isinstance(tenant, Tenant):  # authenticated by this request: read already
        owner_id, weight = tenant.id, tenant.weight
    else:
        with session_scope() as session:
            owner = tenants.find(session, tenant)
            owner_id, weight = owner.id, owner.weight
    with db.autocommit() as connection:
        ahead, own_open, has_budgets = call_rows.call_load(
            connection, spec.name, owner_id, read_budget
        )
    cooldown_s, demand = _model_now(spec)
    wait_s = call_rules.expected_wait_s(ahead, spec.tokens_per_min, cooldown_s)
    demand[owner_id] = call_shares.Demand(weight, running=0, waiting=own_open + 1)
    refusal = call_shares.refuse_call(
        open_calls=own_open,
        share=call_shares.share_of(spec.max_concurrency, demand, owner_id),
        call_s=pace.call_s(spec.name) or 0.0,
        model_wait_s=wait_s,
        deadline_s=deadline_s,
    )
    if refusal is None:
        return has_budgets
    if refusal.status == 429:
        raise OverShare(
            f"this tenant's {own_open} open calls on {spec.name}, at its share of the "
            f"model's slots, need about {refusal.wait_s:.0f}s: more than this call's "
            f"{deadline_s:g}s",
            retry_after_s=refusal.retry_after_s,
        )
    raise Overloaded(
        f"model {spec.name} cannot start this call within its {deadline_s:g}s: "
        f"the calls ahead of it need about {refusal.wait_s:.0f}s",
        retry_after_s=refusal.retry_after_s,
    )


def _key_used(tenant: str | Tenant, key: str | None) -> bool:
    """Whether ``key`` names a request the tenant stored: its replay starts no call (or
    is refused as another request's), so the fail-fast rule does not refuse it."""
    if not key:
        return False
    with session_scope() as session:
        return call_rows.key_used(session, tenants.find(session, tenant).id, key)


def start_call(
    line: dict[str, Any],
    *,
    tenant: str | Tenant,
    endpoint: str,
    deadline_s: float,
    stream: bool = False,
    idempotency_key: str | None = None,
    key_id: int | None = None,
    has_budget: bool | None = None,
) -> PendingCall:
    """Store a call (one item, priority ``call``) and run it in this process, unless it
    cannot start before ``deadline_s``: :class:`Overloaded` (503) when the model's
    calls ahead need longer, :class:`OverShare` (429) when the tenant's own calls do
    (its calls hold at most its weighted share of the model's slots), each with that
    wait as ``retry_after_s`` (:func:`refuse_early`). Wait for its answer with
    :func:`batchgen.worker.call_answers.wait_call`; with ``stream``, read its provider's
    chunks as they arrive with :func:`batchgen.worker.call_answers.stream_call`.

    An ``idempotency_key`` the tenant used for the same request waits for that earlier
    call's answer instead (``stored.replayed``: no second provider call, no second
    ledger row); used for another request, it raises
    :class:`~batchgen.errors.IdempotencyKeyReused` (422). ``key_id``: the API key it
    is made with (its usage is that key's); ``has_budget`` False: no dollar budget
    applies to it (as its key's lookup found), so none is read (None: look)."""
    settings = get_settings()
    body = line.get("body")
    spec = get_registry().get(body.get("model", "")) if isinstance(body, dict) else None
    held = None
    if spec is not None and not _key_used(tenant, idempotency_key):
        # The request's key said whether a budget applies to it; else the fail-fast
        # statement says whether its tenant has any.
        budgeted = refuse_early(spec, tenant, deadline_s, read_budget=has_budget is None)
        if has_budget or budgeted:
            held = money_holds.reserve_call(line, tenant=tenant, key_id=key_id, endpoint=endpoint)
    started = time.monotonic()
    stored = None
    if not idempotency_key and isinstance(tenant, Tenant):  # one statement, most calls
        with db.autocommit() as connection:
            stored = call_rows.store_plain_call(
                connection,
                tenant,
                line,
                deadline_s=deadline_s,
                endpoint=endpoint,
                registry=get_registry(),
                settings=settings,
                key_id=key_id,
            )
    if stored is None:
        with session_scope() as session:
            stored = call_rows.store_call(
                session,
                tenants.find(session, tenant),
                line,
                deadline_s=deadline_s,
                endpoint=endpoint,
                registry=get_registry(),
                settings=settings,
                idempotency_key=idempotency_key,
                key_id=key_id,
            )
    if held is not None and not stored.replayed:
        attempt = stored.queue_ticket.attempt if stored.queue_ticket else 1
        money_holds.adopt_call(held, stored.item_id, attempt)
    relay = ChunkRelay() if stream else None
    woken = call_waiter().register(stored.item_id, event=Wake(relay) if relay else None)
    if stored.replayed:  # the earlier call's run (done, or under way elsewhere) answers it
        return PendingCall(stored, tenant, started + deadline_s, woken, relay=relay)
    pending = PendingCall(
        stored, tenant, started + deadline_s, woken, relay=relay, run_ended=threading.Event()
    )
    _caller_marks(stored, settings)
    # The thread runs in this context (a host app's settings scope goes with it).
    runner = threading.Thread(
        target=contextvars.copy_context().run,
        args=(_run_here, stored, pending.deadline_mono_s, woken, pending.failures, relay, pending),
        name=f"batchgen-call-{stored.item_id}",
        daemon=True,
    )
    runner.start()
    return pending


@functools.cache
def _process_call_runtime() -> tuple[Gate, CancelWatcher]:
    return checked_gate(get_redis(), get_settings()), CancelWatcher(get_redis())


def call_runtime() -> tuple[Gate, CancelWatcher]:
    """The gate and cancel watcher of this process's calls (a host app's scope's own)."""
    scope = current_scope()
    if scope is None:
        return _process_call_runtime()
    return scope.resource(
        ("call_runtime",),
        lambda: (checked_gate(get_redis(), get_settings()), CancelWatcher(get_redis())),
        lambda _: None,  # its Redis client is the scope's
    )


def _run_here(
    stored: call_rows.StoredCall,
    deadline_mono_s: float,
    woken: threading.Event,
    failures: list[BaseException] | None = None,
    relay: ChunkRelay | None = None,
    pending: PendingCall | None = None,
) -> None:
    """Run a call's item in this process, attempt after attempt, until it ends, its
    time is up, or a dispatcher took it (see the module's docstring)."""
    gate, watcher = call_runtime()
    registry, settings = get_registry(), get_settings()
    ticket = stored.queue_ticket
    on_chunk = relay.chunk if relay is not None else None
    on_answer = pending.answer.append if pending is not None else None
    try:
        while ticket is not None:
            if ticket is not stored.queue_ticket:  # the first one is marked at its start
                _run_by_caller(registry.get(stored.model), ticket, settings)
            verdict = run_item(
                stored.item_id,
                registry,
                settings,
                gate,
                watcher,
                model=stored.model,
                ticket=ticket,
                on_chunk=on_chunk,
                on_answer=on_answer,
            )
            if relay is not None:
                relay.ended(verdict.outcome)
            if verdict.outcome == "succeeded" and verdict.call_s is not None:
                pace.note(stored.model, verdict.call_s)
            ticket = verdict.ticket or ticket  # failed over: the next attempt's ticket
            left_s = deadline_mono_s - time.monotonic()
            if left_s <= 0 or (relay is not None and relay.produced):
                break  # the caller has the start of an answer: no retry can finish it
            if verdict.countdown_s is not None:
                time.sleep(min(verdict.countdown_s, left_s))
            elif verdict.outcome in ("retry", "deferred"):
                ticket = _release_again(stored, deadline_mono_s, settings.worker.queued_lease_s)
            else:
                break
    except Exception as exc:
        log.warning(
            "call item %d: %s; its lease will hand it on", stored.item_id, type(exc).__name__
        )
        if failures is not None and isinstance(exc, REDIS_DOWN):
            failures.append(exc)
    finally:
        if pending is not None and pending.run_ended is not None:
            pending.run_ended.set()
        if relay is not None:
            relay.ended(None)
        woken.set()
        first = stored.queue_ticket
        answered = pending is not None and bool(pending.answer)
        if first is not None:  # it asks for no slot now; answered, its caller waits no more
            entry = demand_entry(first.tenant_id, first.tenant_weight, first.item_id)
            _call_ended(stored, entry, answered)
        waker.wake()  # the call held a place in its model's window


class DispatcherWaker:
    """Wakes the dispatcher once calls ended, off their callers' way: a thread sends
    the wake, at most one per ``every_s`` however many calls ended meanwhile."""

    def __init__(self, every_s: float = 0.1) -> None:
        self.every_s = every_s
        self._due = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        self._due.set()
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    # In the context of the call that started it (a host app's scope).
                    self._thread = threading.Thread(
                        target=contextvars.copy_context().run,
                        args=(self._run,),
                        name="batchgen-call-waker",
                        daemon=True,
                    )
                    self._thread.start()

    def _run(self) -> None:
        while self._due.wait(60.0):
            self._due.clear()
            publish.wake_dispatcher_quietly()
            time.sleep(self.every_s)


waker = DispatcherWaker()


def _release_again(
    stored: call_rows.StoredCall, deadline_mono_s: float, queued_lease_s: float
) -> items.Ticket | None:
    """After the item's backoff (its ``not_before``), release it again here; None when
    it is no longer pending (a dispatcher released it, or it ended) or time is up."""
    with session_scope() as session:
        wait_s = call_rows.backoff_left_s(session, stored.item_id)
    if wait_s is None or time.monotonic() + wait_s >= deadline_mono_s:
        return None
    time.sleep(wait_s)
    with session_scope() as session:
        return call_rows.release_again(session, stored.item_id, queued_lease_s)


def _caller_marks(stored: call_rows.StoredCall, settings: Settings) -> None:
    """At a call's start, in one round trip: its caller's presence
    (:func:`caller_waits`) and its first attempt marked as run here
    (:func:`_run_by_caller`). Best effort, as each of them."""
    spec, ticket = get_registry().get(stored.model), stored.queue_ticket
    try:
        pipe = get_redis().pipeline(transaction=False)
        liveness.renew_caller(pipe, stored.item_id, settings.calls.caller_lease_s)
        if spec is not None and ticket is not None:
            ttl_s = running_lease_s(spec, settings) + settings.calls.caller_lease_s
            liveness.mark_run_by_caller(pipe, ticket.item_id, ticket.attempt, ttl_s)
        pipe.execute()
    except Exception as exc:  # noqa: BLE001
        log.debug("call item %d: could not mark it (%s)", stored.item_id, type(exc).__name__)


def _call_ended(stored: call_rows.StoredCall, demand_entry: str, answered: bool) -> None:
    """At the end of a call's run here, in one round trip: it asks for no slot now,
    and, answered, its caller's presence is dropped (it has its answer: see
    :func:`batchgen.worker.call_answers`). Best effort: both lapse anyway."""
    try:
        pipe = get_redis().pipeline(transaction=False)
        pipe.zrem(keys.call_demand(stored.model), demand_entry)
        if answered:
            liveness.drop_caller(pipe, stored.item_id)
        pipe.execute()
    except Exception as exc:  # noqa: BLE001
        log.debug("call item %d: could not end its marks (%s)", stored.item_id, type(exc).__name__)


def _run_by_caller(spec: ModelSpec | None, ticket: items.Ticket, settings: Settings) -> None:
    """Mark the attempt as run in the caller's own process: once its caller is gone, the
    sweep takes it back without waiting for its running lease (a worker's attempt, alive
    without the caller, is left to end). Best effort: unmarked, the lease decides."""
    if spec is None:
        return
    try:
        ttl_s = running_lease_s(spec, settings) + settings.calls.caller_lease_s
        liveness.mark_run_by_caller(get_redis(), ticket.item_id, ticket.attempt, ttl_s)
    except Exception as exc:  # noqa: BLE001
        log.debug("call item %d: could not mark its run (%s)", ticket.item_id, type(exc).__name__)


def caller_waits(item_id: int, lease_s: float) -> None:
    """Renew the caller's presence in Redis: if this process dies, the sweep cancels the
    call instead of handing it to a worker (best effort: a Redis error is no call's end)."""
    try:
        liveness.renew_caller(get_redis(), item_id, lease_s)
    except Exception as exc:  # noqa: BLE001
        log.debug("call item %d: could not renew its caller (%s)", item_id, type(exc).__name__)


def cancel_call(pending: PendingCall) -> None:
    """Cancel a call's batch; a provider call this process runs for it stops at its next
    chunk at once, not when the announcement comes back (a worker's call hears that).
    A replay's caller leaving cancels nothing: the call is the first caller's."""
    if pending.stored.replayed:
        return
    batch_id = pending.stored.batch_id
    cancel_batch(batch_id, pending.tenant)
    call_runtime()[1].cancel(batch_id)
