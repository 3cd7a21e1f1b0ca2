"""Running one delivery of an item: gate, claim, call, record exactly once.

Celery-free, so it can be driven by the task in :mod:`batchgen.tasks.generate` and by
tests alike. The path goes down the layers once: gate on the message's ticket
(concurrency slot, token budget: one script) → claim and mark sent (queued →
running, one statement) → provider call → record the result (one statement in the
common case), or ask :mod:`batchgen.domain.lifecycle.decisions` what a failure means and
apply it → settle the gate (``finally``, one script) → close the batch if this was
its last item. On the gate's wait the item is claimed and handed back for later.
Every item state move is a call into :mod:`batchgen.store.items`.

A pack run as a group (:mod:`batchgen.worker.pack_calls`) takes the same steps for
many items at once, and shares this module's pieces of a call: its request
(:func:`sending_of`), what a failure means (:func:`call_failed`) and what an answer
records (:func:`outcome_of`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from threading import Event
from typing import Any, TypeVar

import redis
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.formats.endpoints import line_endpoint
from batchgen.domain.formats.stream_usage import ReportedUsage, StreamUsage
from batchgen.domain.lifecycle import retry
from batchgen.domain.lifecycle.deadlines import call_timeout_s, time_left_s
from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.domain.scheduling.pools import failover_reason, fails_over
from batchgen.domain.scheduling.routes import (
    FlexWindow,
    ItemRoute,
    call_route,
    flex_timeout_s,
    flex_window,
    with_service_tier,
)
from batchgen.errors import (
    CallCancelled,
    FlexUnavailable,
    ProviderError,
    RateLimited,
    TransientProviderError,
)
from batchgen.limits import liveness
from batchgen.limits.backend import get_redis
from batchgen.limits.gate import Gate, Never, Pass, Wait, WaitKind, running_lease_s
from batchgen.providers import warm_model, warmed_provider
from batchgen.providers.base import Provider, ProviderRequest, ProviderResponse
from batchgen.registry import ModelSpec, Registry
from batchgen.store import batches, db, items, rounds
from batchgen.store.batches import Progress
from batchgen.store.db import session_scope
from batchgen.store.items import Claimed, Ticket
from batchgen.store.ledger import CallOutcome, answered_row, record_answer, record_success
from batchgen.telemetry import tracing
from batchgen.telemetry.genai import CallInfo
from batchgen.worker import money_settle
from batchgen.worker.cancellation import CancelWatcher
from batchgen.worker.failures import cancelled, failed, failover, flex_refused, rate_limited_call
from batchgen.worker.heartbeat import heartbeat
from batchgen.worker.recording import (
    LostClaim,
    after_commit,
    close_batch,
    closing,
    end,
    give_back,
    with_db_retries,
)
from batchgen.worker.verdict import Verdict

log = logging.getLogger(__name__)
money_settle.install()  # each ledger write settles its call's dollar reservation
T = TypeVar("T")
OnChunk = Callable[[dict[str, Any]], None]
# Handed the answer of record once this attempt recorded it (a synchronous call's
# caller, in this process, needs not read it back).
OnAnswer = Callable[[dict[str, Any]], None]


def run_item(
    item_id: int,
    registry: Registry,
    settings: Settings,
    gate: Gate,
    watcher: CancelWatcher | None = None,
    model: str | None = None,
    ticket: Ticket | None = None,
    on_chunk: OnChunk | None = None,
    on_answer: OnAnswer | None = None,
) -> Verdict:
    """Run one delivery of an item end to end.

    ``model`` and ``ticket`` come with the message (its routing hint, and what the
    gate decides on); a message without them costs one lookup of the item first.
    ``on_chunk`` is handed each chunk of a streamed provider answer as it is read (a
    synchronous call relays them to its caller: :mod:`batchgen.worker.relay`), and
    ``on_answer`` the answer this attempt recorded (not called when it recorded none).
    """
    spec = registry.get(model) if model else None
    if ticket is None or spec is None or ticket.item_id != item_id:
        with db.autocommit() as connection:
            found = items.ticket_of(connection, item_id)
        if found is None:  # not queued: a duplicate, cancelled, finished, expired...
            return _not_claimed(item_id, model)
        model_name, ticket = found
        spec = registry.get(model_name)
        if spec is None:
            return Verdict("skipped")
    tenant = ticket.tenant_name or str(ticket.tenant_id)
    with tracing.attempt(item_id, ticket.batch_id, tenant, ticket.attempt, spec.name):
        verdict = _run_ticket(ticket, spec, settings, gate, watcher, on_chunk, on_answer)
    return replace(verdict, model=spec.name)


def _run_ticket(
    ticket: Ticket,
    spec: ModelSpec,
    settings: Settings,
    gate: Gate,
    watcher: CancelWatcher | None,
    on_chunk: OnChunk | None = None,
    on_answer: OnAnswer | None = None,
) -> Verdict:
    """Gate first, then claim: on the gate's yes, one statement claims the item and
    marks it sent; on a wait, the item is claimed and handed back for later."""
    lease_s = running_lease_s(spec, settings)
    warm_model(spec)  # the SDK's first import before the budget's yes, not after
    decision = tracing.gated(gate.enter, spec, ticket)  # a Redis error: nothing claimed yet
    if not isinstance(decision, Pass):
        item = _claim(ticket.item_id, lease_s, ticket.attempt)
        if item is None:  # duplicate, cancelled, finished, or past its deadline
            return _not_claimed(ticket.item_id, spec.name)
        return _wait(item, decision, settings)
    settlement = Settlement()
    try:
        # The model as the deployment the gate picked serves it: its endpoint, key,
        # limits and prices (the model itself when it has one deployment).
        served = spec.at(decision.deployment)
        # Built before the claim marks the item sent: a first call's client (seconds of
        # SDK imports in a fresh process) is no window in which a process killed would
        # leave an item marked sent that never left.
        provider = warmed_provider(served)
        # Watching before the claim: a cancel that commits after it is heard at once.
        with watcher.watch(ticket.batch_id) if watcher else nullcontext(Event()) as cancel:
            item = _claim_sent(ticket, lease_s, settings, served.served_by)
            if item is None:
                return _not_claimed(ticket.item_id, spec.name)
            if item.model != spec.name:  # a message routed under another model's name
                give_back(item, settings)
                return Verdict("skipped")
            with heartbeat().hold(item, lease_s):  # renewed until its outcome is recorded
                call = _Call(item, spec, served, ticket)
                return _call(call, provider, settings, cancel, settlement, on_chunk, on_answer)
    finally:
        _settle(gate, spec, decision, ticket, settlement)


def _claim(item_id: int, lease_s: float, attempt: int | None = None) -> Claimed | None:
    """One statement, one round trip. A pooled connection whose backend died (a
    failover) fails its first statement and invalidates the pool: the claim is tried
    once more, on a fresh connection (nothing was claimed: the statement failed)."""
    for last_try in (False, True):
        read_mono_s = time.monotonic()  # before the statement whose now() the claim returns
        try:
            with db.autocommit() as connection:
                return items.claim(connection, item_id, lease_s, read_mono_s, attempt=attempt)
        except Exception as exc:
            if last_try or not db.is_transient(exc):
                raise
            log.warning(
                "item %d: database error claiming (%s), once more", item_id, type(exc).__name__
            )
    raise AssertionError("unreachable")


def _claim_sent(
    ticket: Ticket, lease_s: float, settings: Settings, deployment: str | None = None
) -> Claimed | None:
    """Claim and mark sent, one statement. On a database error the statement may have
    committed with its reply lost: the attempt is handed back (a no-op if it did not
    commit), and the claim tried once more on a fresh connection (see :func:`_claim`)."""
    for last_try in (False, True):
        read_mono_s = time.monotonic()
        token = items.new_claim_token()
        try:
            with db.autocommit() as connection:
                return items.claim_sent(
                    connection, ticket, lease_s, read_mono_s, deployment, claim_token=token
                )
        except Exception as exc:
            if not db.is_transient(exc):
                raise
            maybe = LostClaim(ticket.item_id, ticket.attempt, read_mono_s + lease_s, token)
            _mark_unsent(maybe, lease_s)
            give_back(maybe, settings)
            if last_try:
                raise
            log.warning(
                "item %d: database error claiming (%s), once more",
                ticket.item_id,
                type(exc).__name__,
            )
    raise AssertionError("unreachable")


# How long a lost claim's "never sent" mark outlives it: past any outage after which
# the sweep could find the attempt marked sent in PostgreSQL.
UNSENT_MARK_S = 24 * 3600.0


def _mark_unsent(maybe: LostClaim, lease_s: float) -> None:
    """The claim that marks the item sent may have committed with its reply lost; this
    worker sends nothing for it. Told in Redis, the sweep then ledgers no waste for an
    attempt whose request never left (PostgreSQL itself may be away now)."""
    try:
        client = get_redis()
        liveness.mark_unsent(client, maybe.item_id, maybe.claim_token, UNSENT_MARK_S + lease_s)
    except Exception as exc:  # noqa: BLE001 - Redis away too: the sweep over-counts, safely
        log.warning(
            "item %d: could not mark its lost claim unsent (%s)", maybe.item_id, type(exc).__name__
        )


def _not_claimed(item_id: int, model: str | None) -> Verdict:
    """The claim matched nothing: expire the item if its deadline passed (closing its
    batch if that was its last open item), else skip the delivery."""
    with session_scope() as session:
        batch_id = items.expire_unstarted(session, item_id)
        progress = batches.close_if_done(session, batch_id) if batch_id else None
    if batch_id is None:
        return Verdict("skipped", model=model)
    if progress is Progress.TAIL:
        close_batch(batch_id, item_id)
    return Verdict("expired", model=model)


def _wait(item: Claimed, decision: Wait | Never, settings: Settings) -> Verdict:
    """The gate said no: hand the item back (short wait, long wait) or end it.

    Only a firm wait past the deadline expires the item (:func:`retry.plan_wait`);
    a tenant-budget wait goes back to pending so it holds no dispatch capacity.
    """
    if isinstance(decision, Never):
        end(item, ItemStatus.FAILED, "too_large", decision.reason)
        return Verdict("failed")
    with session_scope() as session:
        plan = retry.plan_wait(
            decision.wait_s,
            time_left_s(item.deadline_at, item.now),
            firm=decision.kind.firm,
            releases_dispatch=decision.kind.releases_dispatch,
            max_countdown_s=settings.worker.max_countdown_s,
        )
        if plan.action is retry.WaitAction.DEFER:
            deferred = items.defer(session, item, plan.wait_s, decision.reason)
            if deferred and decision.kind is WaitKind.TENANT:
                # Its other items would meet the same no: the dispatcher passes the
                # tenant over until its budget frees, and gives its places to others.
                rounds.hold_tenant(session, item.tenant_id, plan.wait_s)
            return Verdict("deferred")
        if plan.action is retry.WaitAction.REQUEUE:
            items.requeue(session, item, plan.wait_s, settings.worker.queued_lease_s)
            return Verdict("wait", plan.wait_s)
    message = f"{decision.reason}: the wait would pass the deadline"
    end(item, ItemStatus.EXPIRED, "expired", message)
    return Verdict("expired")


# What the gate is settled with when nothing reached the provider: the whole
# reservation is given back.
NOT_SENT = CallCancelled("not sent", billed=False)
# From the send on, unless told otherwise, the reservation is kept (the provider
# may have counted the call).
MAYBE_SENT = TransientProviderError("the call did not end normally", billed=True)


@dataclass
class Settlement:
    """How the call ended, for :meth:`Gate.settle` (filled in as the call goes)."""

    response: ProviderResponse | None = None
    error: ProviderError | None = NOT_SENT
    # The call's time-out was its item's time left, shorter than the model's own.
    cut_by_deadline: bool = False


def _settle(
    gate: Gate, spec: ModelSpec, admitted: Pass, item: Ticket, settlement: Settlement
) -> None:
    """Budget bookkeeping after a call; a Redis error must not undo the call's outcome."""
    outcome: dict[str, Any] = (
        {"response": settlement.response}
        if settlement.response is not None
        else {"error": settlement.error}
    )
    try:
        if settlement.error is NOT_SENT:
            gate.settle_unsent(spec, admitted, item.tenant_id, item.max_tokens, NOT_SENT)
        else:
            outcome["cut_by_deadline"] = settlement.cut_by_deadline
            gate.settle(spec, admitted, item.tenant_id, item.max_tokens, **outcome)
    except redis.RedisError:
        log.warning(
            "item %d: Redis error settling the budget; the reservation ages out", item.item_id
        )


@dataclass(frozen=True)
class _Call:
    """One call of a claimed item: the model, the model as the deployment the gate
    picked serves it, and the ticket the item was delivered with."""

    item: Claimed
    spec: ModelSpec
    served: ModelSpec
    ticket: Ticket


def _call(
    call: _Call,
    provider: Provider,
    settings: Settings,
    cancel: Event,
    settlement: Settlement,
    on_chunk: OnChunk | None = None,
    on_answer: OnAnswer | None = None,
) -> Verdict:
    sending = sending_of(call, settings, cancel, settlement, on_chunk)
    started = time.monotonic()
    settlement.error = MAYBE_SENT
    try:
        response = tracing.called(
            lambda: call_info(call, sending), provider.complete, sending.request
        )
    except ProviderError as exc:
        settlement.error = exc
        return call_failed(call, sending, settings, exc, time.monotonic() - started)
    settlement.response, settlement.error = response, None
    latency_s = time.monotonic() - started
    outcome = outcome_of(call, sending, response, latency_s)
    recorded = tracing.ledgered(
        lambda: _record(call.item, outcome, call.served),
        lambda: call_info(call, sending),
        call.item.created_at,
        latency_s,
    )
    if recorded and on_answer is not None:
        on_answer(response.body)
    if on_chunk is not None:
        _forget_usage(call.item)
    log_answer(call, sending, response, latency_s, recorded)
    return Verdict("succeeded" if recorded else "duplicate", call_s=latency_s)


@dataclass(frozen=True)
class Sending:
    """A claimed item's request as it goes to the provider, with its route."""

    request: ProviderRequest
    route: ItemRoute
    flex: FlexWindow | None


def sending_of(
    call: _Call,
    settings: Settings,
    cancel: Event,
    settlement: Settlement,
    on_chunk: OnChunk | None = None,
) -> Sending:
    """The request of ``call``: its route (standard or flex) and time-out from the time
    its item has left (on PostgreSQL's clock, where the deadline was set, not this
    host's); ``settlement`` learns whether that time-out was cut by the deadline."""
    item, spec, served = call.item, call.spec, call.served
    configured_s = spec.call_timeout_s or settings.providers.call_timeout_s
    left_s = time_left_s(item.deadline_at, item.db_now())
    flex = flex_window(spec, served, configured_s)
    route = call_route(ItemRoute(item.route), flex, left_s, flex_offered=served.flex is not None)
    timeout = call_timeout_s(configured_s, item.deadline_at, item.db_now())
    if route is ItemRoute.FLEX and flex is not None:
        timeout = flex_timeout_s(flex, left_s)  # a standard call's time is always left
    # A time-out this short was the item's own doing: not the deployment's to answer for.
    settlement.cut_by_deadline = timeout < configured_s
    request = ProviderRequest(
        spec=served,
        body=with_service_tier(item.body, route),
        timeout_s=timeout,
        item_id=item.item_id,
        cancel=cancel,
        stream=settings.providers.stream_calls,
        lean_http=settings.providers.lean_http,
        endpoint=line_endpoint(item.endpoint),
        on_chunk=_keeping_usage(item, on_chunk) if on_chunk is not None else None,
        cache_prefix=item.prefix_key is not None,
    )
    return Sending(request, route, flex)


def call_info(call: _Call, sending: Sending) -> CallInfo:
    """What the spans of ``call`` say about it (ids, names, the route: never text)."""
    item, ticket = call.item, call.ticket
    return CallInfo(
        model=call.spec.name,
        spec=call.served,
        endpoint=sending.request.endpoint,
        tenant=ticket.tenant_name or str(item.tenant_id),
        batch_id=item.batch_id,
        item_id=item.item_id,
        attempt=item.attempt,
        route=sending.route.value,
        stream=sending.request.stream,
        tier=sending.route.tier,
    )


def call_failed(
    call: _Call, sending: Sending, settings: Settings, exc: ProviderError, call_s: float
) -> Verdict:
    """What a failed call means for its item, applied (recorded): cancelled, refused
    flex, failed over, handed back after a 429, or failed (after its retries)."""
    item, spec, served = call.item, call.spec, call.served
    route, flex = sending.route, sending.flex
    tier = route.tier
    if isinstance(exc, CallCancelled):
        return Verdict(cancelled(item, served, exc, tier), call_s=call_s)
    if isinstance(exc, FlexUnavailable) and route is ItemRoute.FLEX and flex is not None:
        return flex_refused(item, flex, settings, exc)  # a refusal is no call's time
    failing_over = fails_over(
        deployments=len(spec.deployments),
        reason=failover_reason(exc),
        failovers=item.failovers,
        max_failovers=settings.providers.max_failovers,
        time_left_s=time_left_s(item.deadline_at, item.db_now()),
    )
    if failing_over:
        latency_ms = int(call_s * 1000)
        verdict = failover(item, served, settings, exc, latency_ms, call.ticket, tier)
        return replace(verdict, call_s=None if isinstance(exc, RateLimited) else call_s)
    if isinstance(exc, RateLimited) and not exc.billed:
        return rate_limited_call(item, settings, exc)  # a 429 is no call's time
    verdict_of = failed(item, served, settings, exc, int(call_s * 1000), tier)
    return Verdict(verdict_of, call_s=call_s)


def outcome_of(
    call: _Call, sending: Sending, response: ProviderResponse, latency_s: float
) -> CallOutcome:
    """The paid answer of ``call``, as the ledger records it."""
    item = call.item
    return CallOutcome(
        item_id=item.item_id,
        attempt=item.attempt,
        prompt_tokens=response.prompt_tokens,
        completion_tokens=response.completion_tokens,
        response=response.body,
        provider_request_id=response.request_id,
        upstream_latency_ms=int(latency_s * 1000),
        queue_wait_ms=max(0, int((item.started_at - item.created_at).total_seconds() * 1000)),
        deployment=call.served.served_by,
        tier=sending.route.tier,
    )


def log_answer(
    call: _Call, sending: Sending, response: ProviderResponse, latency_s: float, recorded: bool
) -> None:
    log.info(
        "item %d attempt %d model %s deployment %s route %s succeeded prompt_tokens=%d "
        "completion_tokens=%d latency_ms=%d recorded=%s",
        call.item.item_id,
        call.item.attempt,
        call.spec.name,
        call.served.served_by,
        sending.route.value,
        response.prompt_tokens,
        response.completion_tokens,
        latency_s * 1000,
        recorded,
    )


def _keeping_usage(item: Claimed, relay: OnChunk) -> OnChunk:
    """``relay``, once the provider's usage is kept in Redis as soon as its stream
    reports it, before the chunk is passed on: if this process dies before it records
    the answer, the sweep ledgers what the provider billed rather than an estimate."""
    stream = StreamUsage()

    def on_chunk(chunk: dict[str, Any]) -> None:
        usage = stream.add(chunk)
        if usage is not None:
            _keep_usage(item, usage)
        relay(chunk)

    return on_chunk


def _keep_usage(item: Claimed, usage: ReportedUsage) -> None:
    try:
        # As long as an unsent mark: past any outage after which the sweep could ask.
        ttl_s = UNSENT_MARK_S
        liveness.keep_usage(get_redis(), item.item_id, item.attempt, usage.to_json(), ttl_s)
    except Exception as exc:  # noqa: BLE001 - Redis away: a lost call ledgers its estimate
        log.warning("item %d: could not keep its usage (%s)", item.item_id, type(exc).__name__)


def _forget_usage(item: Claimed) -> None:
    with contextlib.suppress(Exception):  # the key expires by itself
        liveness.drop_usage(get_redis(), item.item_id, item.attempt)


def _record(item: Claimed, outcome: CallOutcome, spec: ModelSpec) -> bool:
    """A paid answer is recorded before anything else; a database outage is waited out
    for as long as the lease lasts. One statement when this attempt still runs the item
    (the common case); otherwise the general path sorts out what the answer is."""
    answered = with_db_retries(
        item,
        "recording the result",
        lambda connection: record_answer(connection, item, outcome, spec),
        scope=db.autocommit,
    )
    if answered.recorded:
        money_settle.settle([answered_row(item, outcome, spec)])
        if not answered.waiting and not answered.closed:  # it may be done
            close_batch(item.batch_id, item.item_id)
        return True
    progress: list[Progress] = []

    def work(session: Session) -> bool:
        recorded = record_success(session, outcome, spec)
        if recorded:
            closing(session, item, progress)
        return recorded

    recorded = with_db_retries(item, "recording the result", work)
    after_commit(item, progress)
    return recorded
