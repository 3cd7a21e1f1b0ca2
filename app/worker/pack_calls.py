"""A pack run as a group: its items' gates, claims, records and settlements in one round
trip each, their calls overlapping.

:mod:`batchgen.worker.packs` runs a pack's items one after another, each exactly as a
message of its own (:func:`batchgen.worker.execution.run_item`): five round trips an
item (the gate's script, the claim, the call, the record, the settling script). Here
the pack's items go through each step together:

1. **Gate**: every item's entry in one script call
   (:meth:`batchgen.limits.gate.Gate.enter_many`), each as if entered alone, so the
   model's slots and budget hold exactly as for single entries. Items denied a slot
   are entered again (one call for all of them) as soon as one of the pack's own
   calls has ended or another pack of the process has freed one of the model's slots,
   or every ``SLOT_POLL_S`` meanwhile, for up to ``slot_wait_s``
   since the pack last got a slot: the pack holds as many slots as it has calls in
   flight, never more, and never more than the model's ``max_concurrency`` across
   all workers.
2. **Claim**: the admitted items claimed and marked sent in one statement
   (:func:`batchgen.store.items.claim_sent_many`).
3. **Calls**: each on a thread of the process's call pool when the model's calls are
   slow (they overlap: a pack of eight 200 ms calls takes 200 ms), or one after
   another on the message's own thread when they are short (the pace of
   :class:`batchgen.worker.packs.CallPace`: ``pack_target_s`` covers them all), where
   a thread switch would cost more than it saves. Each call keeps its own deadline,
   time-out, cancel event and heartbeat.
4. **Settle**: the calls that have ended, their settlements in one script call
   (:meth:`batchgen.limits.gate.Gate.settle_many`), as soon as they end: a slot is a
   call at the provider, and frees as the call does, not once its answer is stored.
5. **Record**: the answers are written in one statement (a group commit,
   :func:`batchgen.store.ledger.record_answers`): ledger rows, results, daily totals,
   items succeeded. Overlapping calls that end within ``RECORD_GATHER_S`` of each other
   (or while the first one's answer waits for the rest of the pack) share the
   statement. An answer that statement does not record (its attempt no longer runs
   the item) takes the general path alone, as does every failed call
   (:func:`batchgen.worker.execution.call_failed`). Each item stays claimed, held by
   its heartbeat, until its outcome is recorded.

Waits are the pack's as in :func:`batchgen.worker.packs.run_pack`: the first item that
meets a wait (slots still all held after ``slot_wait_s``, the budget, a cooldown) is
handed back with its countdown and the items not yet entered wait with it, in one
retry message; a failover's next attempt is handed back at once.

Exactly-once is the single path's: an item is claimed for one attempt, marked sent in
the claim, held by the heartbeat until its outcome is recorded, and a worker killed
mid-pack leaves its claimed items to their leases and the sweep (which ledgers the
calls that may have been billed), its unclaimed ones queued.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from threading import Event

import redis

from batchgen.config import Settings
from batchgen.domain.lifecycle.decisions import room_elsewhere, rounds_stop
from batchgen.errors import ProviderError
from batchgen.limits.concurrency import Slots
from batchgen.limits.gate import (
    SLOT_POLL_S,
    Gate,
    Never,
    Pass,
    Settling,
    Wait,
    WaitKind,
    running_lease_s,
)
from batchgen.limits.slot_wakeups import WAKEUPS
from batchgen.providers import warm_model, warmed_provider
from batchgen.providers.base import Provider, ProviderResponse
from batchgen.registry import ModelSpec
from batchgen.store import db, items
from batchgen.store.items import Claimed, Ticket
from batchgen.store.ledger import CallOutcome, answered_row, record_answers
from batchgen.telemetry import tracing
from batchgen.worker import host_cpu, money_settle
from batchgen.worker.cancellation import CancelWatcher
from batchgen.worker.execution import (
    MAYBE_SENT,
    NOT_SENT,
    Sending,
    Settlement,
    _Call,
    _claim,
    _mark_unsent,
    _not_claimed,
    _record,
    _settle,
    _wait,
    call_failed,
    call_info,
    log_answer,
    outcome_of,
    sending_of,
)
from batchgen.worker.heartbeat import heartbeat
from batchgen.worker.packs import PackItem, PackOutcome
from batchgen.worker.recording import LostClaim, close_batch, give_back, with_db_retries
from batchgen.worker.verdict import Verdict

log = logging.getLogger(__name__)

# The process's call threads: created as calls need them, idle ones reused.
CALL_THREADS = 512
# How long an answer that has come back (its slot freed already) may wait for the pack's
# other calls before it is recorded: the calls of a pack end close together, and one
# statement for several answers costs little more than one for one.
RECORD_GATHER_S = 0.1


@functools.cache
def _call_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=CALL_THREADS, thread_name_prefix="batchgen-call")


@dataclass
class _Flight:
    """One claimed item of the pack, from its claim to its settlement."""

    entry: PackItem
    call: _Call
    admitted: Pass
    settlement: Settlement
    hold: contextlib.ExitStack
    settings: Settings
    provider: Provider
    sending: Sending | None = None
    response: ProviderResponse | None = None
    verdict: Verdict | None = None  # a failed call's, applied already
    latency_s: float = 0.0
    raised: BaseException | None = None  # an error no call should raise (a bug)
    landed_s: float = 0.0  # when its call ended (monotonic)
    trace: tracing.Packed | None = None  # its delivery span, when tracing is on


@dataclass
class _Pack:
    """What became of the pack's items so far (by item id, and the lists of
    :class:`~batchgen.worker.packs.PackOutcome`)."""

    verdicts: dict[int, Verdict] = field(default_factory=dict)
    waiting: list[PackItem] = field(default_factory=list)
    countdown_s: float | None = None
    handed_back: list[PackItem] = field(default_factory=list)

    def wait_with(self, entry: PackItem, countdown_s: float) -> None:
        self.waiting.append(entry)
        self.countdown_s = max(self.countdown_s or 0.0, countdown_s)


def run_together(
    pack: Sequence[PackItem],
    spec: ModelSpec,
    tickets: Sequence[Ticket],
    settings: Settings,
    gate: Gate,
    watcher: CancelWatcher | None,
    overlap: bool,
    note: Callable[[Verdict], None],
    round_items: int | None = None,
) -> PackOutcome:
    """Run ``pack`` (its items' ``tickets``, all readable, all of model ``spec``) as a
    group; ``overlap``: its calls on threads of their own. ``note`` hears every
    verdict as it comes (the calls' pace, the refill). An error (a database or Redis
    outage) stops the entries: the items not entered are handed back, those in flight
    end as usual, and the error is in the outcome.

    Calls one after another go in rounds of ``round_items`` (None: all at once), each
    entered, claimed, recorded and settled together; once the pack has run
    ``settings.packs.max_s`` and its calls turned slow, with room among the model's
    slots for them to run alongside (:func:`batchgen.domain.lifecycle.decisions.rounds_stop`),
    the rounds not begun are handed back, as :func:`batchgen.worker.packs.run_pack`
    hands back its untried items."""
    run = _Run(spec, settings, gate, watcher, overlap, note)
    todo = list(zip(pack, tickets, strict=True))
    later: list[tuple[PackItem, Ticket]] = []  # the rounds not begun
    if not overlap and round_items is not None:
        todo, later = todo[: max(1, round_items)], todo[max(1, round_items) :]
        if later and settings.packs.busy_host_keeps_rest:  # read only at a round's end
            run.cpu_mark = host_cpu.mark()
    started = time.monotonic()
    error: Exception | None = None
    slot_deadline = time.monotonic() + settings.worker.slot_wait_s
    probe = False  # the slots were all held at the last try: one item asks first
    try:
        while todo or run.flying or later:
            if not todo and not run.flying:  # the round has landed: the next one
                if run.pack.waiting:
                    run.pack.waiting.extend(entry for entry, _ in later)
                    later = []
                    break
                quickest_s, run.quickest_s = run.quickest_s, None
                ran_s = time.monotonic() - started
                if rounds_stop(
                    quickest_s,
                    ran_s,
                    settings.packs.target_s,
                    settings.packs.max_s,
                    settings.worker.queued_lease_s,
                    functools.partial(run.room_elsewhere, quickest_s),
                ):
                    run.pack.handed_back.extend(entry for entry, _ in later)
                    later = []
                    break
                size = max(1, round_items or len(later))
                todo, later = later[:size], later[size:]
                slot_deadline = time.monotonic() + settings.worker.slot_wait_s
            if todo and not run.pack.waiting:
                last_try = time.monotonic() >= slot_deadline
                todo, entered = run.enter(todo, last_try, probe)
                probe = bool(todo) and not entered
                if entered:
                    slot_deadline = time.monotonic() + settings.worker.slot_wait_s
            if run.pack.waiting and (todo or later):  # the rest would meet the same wait
                run.pack.waiting.extend(entry for entry, _ in todo + later)
                todo, later = [], []
            run.land(poll_s=SLOT_POLL_S if todo else None)
        run.settle_unsent()
    except Exception as exc:  # the rest of the pack goes back; what flies lands first
        error = exc
        run.pack.handed_back.extend(entry for entry, _ in todo + later)
        while run.flying or run.landed or run.unrecorded:  # each land() takes some off
            with contextlib.suppress(Exception):
                run.land(poll_s=None)
        with contextlib.suppress(Exception):
            run.settle_unsent()
    ran = [p.item_id for p in pack if p.item_id in run.pack.verdicts]
    return PackOutcome(
        [run.pack.verdicts[i] for i in ran],
        run.pack.waiting,
        run.pack.countdown_s,
        run.pack.handed_back,
        error=error,
        ran=ran,
    )


class _Run:
    """One pack's run: its entries, its calls in flight and their landing."""

    def __init__(
        self,
        spec: ModelSpec,
        settings: Settings,
        gate: Gate,
        watcher: CancelWatcher | None,
        overlap: bool,
        note: Callable[[Verdict], None],
    ) -> None:
        self.spec, self.settings, self.gate, self.watcher = spec, settings, gate, watcher
        self.overlap, self.note = overlap, note
        self.lease_s = running_lease_s(spec, settings)
        self.pack = _Pack()
        self.flying: dict[Future[None], _Flight] = {}
        self.landed: list[_Flight] = []  # calls made inline, not yet settled
        self.unrecorded: list[_Flight] = []  # settled, their outcomes not yet recorded
        self.record_by_s = 0.0  # when the first of them is recorded at the latest
        self.unsent: list[tuple[Pass, Ticket]] = []  # entered, not claimed: settle last
        self.quickest_s: float | None = None  # the quickest answer since the last look
        self.gated_ns: dict[int, tuple[int, int]] = {}  # its entry call, by item id
        self.wake = Event()  # one of its calls ended, or a slot of its model freed
        self.cpu_mark: host_cpu.CpuMark | None = None  # the host's CPUs as its rounds began

    def room_elsewhere(self, quickest_s: float | None) -> bool:
        """Whether the pack's rest handed back would run alongside its calls
        (:func:`~batchgen.domain.lifecycle.decisions.room_elsewhere`: the host's CPUs
        since the pack began and its last round's ``quickest_s``, the model's slots);
        Redis unreachable: yes, the rest is handed back as it always was."""
        packs = self.settings.packs
        try:
            return room_elsewhere(
                host_cpu.busy_share(self.cpu_mark),  # no mark: the setting is off
                quickest_s,
                packs.max_s,
                lambda: Slots(self.gate.client).held(self.spec.name),
                self.spec.max_concurrency,
                packs.max_items,
            )
        except redis.RedisError:
            return True

    def done(self, entry: PackItem, verdict: Verdict) -> None:
        verdict = verdict if verdict.model else replace(verdict, model=self.spec.name)
        self.pack.verdicts[entry.item_id] = verdict
        self.note(verdict)

    # --- 1. the gate --------------------------------------------------------------------

    def enter(
        self, todo: list[tuple[PackItem, Ticket]], last_try: bool, probe: bool
    ) -> tuple[list[tuple[PackItem, Ticket]], int]:
        """Enter ``todo``; returns the items denied a slot, to try again, and how many
        were let through. Calls that overlap take a slot each: all entered in one round
        trip, or (``probe``: the pack found the slots all held last time) the first
        alone, then the rest if it got one. Calls one after another hold one slot
        together: the first item takes it, the rest only their budget."""
        head, tail = (todo[:1], todo[1:]) if probe or not self.overlap else (todo, [])
        again, passed = self._enter(head, last_try, slots=True)
        if tail and passed and not self.pack.waiting:
            more_again, more_passed = self._enter(tail, last_try, slots=self.overlap)
            again += more_again
            passed += more_passed
        else:
            again += tail
        self._claim(passed)
        return again, len(passed)

    def _enter(
        self, todo: list[tuple[PackItem, Ticket]], last_try: bool, slots: bool
    ) -> tuple[list[tuple[PackItem, Ticket]], list[tuple[PackItem, Ticket, Pass]]]:
        warm_model(self.spec)  # the SDK's first import before the budget's yes, not after
        entered_ns = time.time_ns()
        decisions = self.gate.enter_many(
            self.spec, [t for _, t in todo], last_try=last_try, slots=slots
        )
        gated_ns = (entered_ns, time.time_ns())
        passed: list[tuple[PackItem, Ticket, Pass]] = []
        again: list[tuple[PackItem, Ticket]] = []
        for (entry, ticket), decision in zip(todo, decisions, strict=True):
            if isinstance(decision, Pass):
                passed.append((entry, ticket, decision))
                self.gated_ns[ticket.item_id] = gated_ns
            elif self.pack.waiting:  # a wait met first: the pack's rest waits with it
                self.pack.waiting.append(entry)
            elif isinstance(decision, Wait) and decision.kind is WaitKind.SLOT and not last_try:
                again.append((entry, ticket))
            else:
                self._denied(entry, ticket, decision)
        return again, passed

    def _denied(self, entry: PackItem, ticket: Ticket, decision: Wait | Never) -> None:
        """As :func:`batchgen.worker.execution._run_ticket` on the gate's no: the item is
        claimed and handed back for later, deferred, expired, or ended."""
        item = _claim(ticket.item_id, self.lease_s, ticket.attempt)
        if item is None:
            self.done(entry, _not_claimed(ticket.item_id, self.spec.name))
            return
        verdict = _wait(item, decision, self.settings)
        if verdict.countdown_s is not None:
            self.pack.wait_with(entry, verdict.countdown_s)
            self.pack.verdicts[entry.item_id] = verdict
            return
        self.done(entry, verdict)

    # --- 2. the claim, and the calls ----------------------------------------------------

    def _claim(self, passed: list[tuple[PackItem, Ticket, Pass]]) -> None:
        if not passed:
            return
        flights: list[tuple[PackItem, Ticket, Pass, ModelSpec]] = []
        providers: dict[str, Provider] = {}
        try:
            for entry, ticket, admitted in passed:
                served = self.spec.at(admitted.deployment)
                if admitted.deployment not in providers:  # built before the claim
                    providers[admitted.deployment] = warmed_provider(served)
                flights.append((entry, ticket, admitted, served))
            claimed = self._claim_sent(flights)
        except BaseException:
            for _, ticket, admitted in passed:
                _settle(self.gate, self.spec, admitted, ticket, Settlement())
            raise
        for entry, ticket, admitted, served in flights:
            item = claimed.get(ticket.item_id)
            if item is None or item.model != self.spec.name:
                if self.overlap:
                    _settle(self.gate, self.spec, admitted, ticket, Settlement())  # not sent
                else:  # it may hold the slot the pack's calls run under: at the end
                    self.unsent.append((admitted, ticket))
                if item is None:
                    self.done(entry, _not_claimed(ticket.item_id, self.spec.name))
                else:  # a message routed under another model's name
                    give_back(item, self.settings)
                    self.done(entry, Verdict("skipped"))
                continue
            self._fly(entry, ticket, admitted, served, item, providers[admitted.deployment])

    def _claim_sent(
        self, flights: list[tuple[PackItem, Ticket, Pass, ModelSpec]]
    ) -> dict[int, Claimed]:
        """One statement; on a database error each claim may have committed with its
        reply lost: every attempt is handed back, and the claim tried once more (see
        :func:`batchgen.worker.execution._claim_sent`)."""
        claims = [(ticket, served.served_by) for _, ticket, _, served in flights]
        for last_try in (False, True):
            read_mono_s = time.monotonic()
            token = items.new_claim_token()
            try:
                with db.autocommit() as connection:
                    return items.claim_sent_many(
                        connection, claims, self.lease_s, read_mono_s, claim_token=token
                    )
            except Exception as exc:
                if not db.is_transient(exc):
                    raise
                for ticket, _ in claims:
                    maybe = LostClaim(
                        ticket.item_id, ticket.attempt, read_mono_s + self.lease_s, token
                    )
                    _mark_unsent(maybe, self.lease_s)
                    give_back(maybe, self.settings)
                if last_try:
                    raise
                log.warning("a pack's claim: database error (%s), once more", type(exc).__name__)
        raise AssertionError("unreachable")

    def _fly(
        self,
        entry: PackItem,
        ticket: Ticket,
        admitted: Pass,
        served: ModelSpec,
        item: Claimed,
        provider: Provider,
    ) -> None:
        hold = contextlib.ExitStack()
        try:  # until it flies: on an error nothing holds the item (its lease runs out)
            watcher = self.watcher
            cancel = hold.enter_context(watcher.watch(item.batch_id)) if watcher else Event()
            hold.enter_context(heartbeat().hold(item, self.lease_s))
            call = _Call(item, self.spec, served, ticket)
            flight = _Flight(entry, call, admitted, Settlement(), hold, self.settings, provider)
            now_ns = time.time_ns()
            flight.trace = tracing.packed(
                item.item_id,
                item.batch_id,
                ticket.tenant_name or str(ticket.tenant_id),
                ticket.attempt,
                self.spec.name,
                self.gated_ns.pop(ticket.item_id, (now_ns, now_ns)),
                admitted.deployment,
            )
            hold.callback(tracing.end, flight.trace)  # once its outcome is recorded
            flight.sending = sending_of(flight.call, self.settings, cancel, flight.settlement)
            future = _call_pool().submit(_send, flight) if self.overlap else None
        except BaseException:
            hold.close()
            raise
        if future is not None:
            future.add_done_callback(self._call_ended)
            self.flying[future] = flight
        else:
            _send(flight)
            self.landed.append(flight)

    # --- 3. landing: settle what came back, and record it ------------------------------

    def land(self, poll_s: float | None) -> None:
        """Settle the calls that have ended (at least one, or whatever ended within
        ``poll_s``; None: wait for one), and record what has been settled once no call
        of the pack flies any more, its calls run inline, or the first of them has
        waited ``RECORD_GATHER_S``. With nothing in flight, wait ``poll_s`` for another
        pack of the process to free a slot."""
        done = self.landed
        self.landed = []
        if self.flying and not done:
            timeout_s = poll_s
            if self.unrecorded:  # not past the time they are to be recorded
                left_s = max(0.0, self.record_by_s - time.monotonic())
                timeout_s = left_s if timeout_s is None else min(timeout_s, left_s)
            self._await(timeout_s, slots=poll_s is not None)
        if self.flying:
            done += [self.flying.pop(f) for f in [f for f in self.flying if f.done()]]
        elif not done and not self.unrecorded and poll_s is not None:
            self._await(poll_s, slots=True)
        raised = [f.raised for f in done if f.raised is not None]
        if done:
            if not self.unrecorded:
                self.record_by_s = time.monotonic() + RECORD_GATHER_S
            self.unrecorded += done
            try:
                self._settle(done)
            except BaseException:  # what it left is recorded before the error goes on
                self._record_unrecorded()
                raise
        # A failed call's outcome is applied already: its retry or wait goes out at once.
        at_once = raised or any(f.verdict is not None for f in done)
        if at_once or not self.flying or not self.overlap or time.monotonic() >= self.record_by_s:
            self._record_unrecorded()
        if raised:  # a call that raised what no call should: the pack's error
            raise raised[0]

    def _call_ended(self, _: Future[None]) -> None:
        self.wake.set()

    def _await(self, timeout_s: float | None, slots: bool) -> None:
        """Until one of the pack's calls ends or (``slots``: it has items waiting for a
        slot) a pack here or elsewhere frees a slot of its model, at most ``timeout_s``
        (None: until a call ends)."""
        self.wake.clear()  # before looking: a call that ends meanwhile sets it again
        if any(f.done() for f in self.flying):
            return
        if not slots:
            self.wake.wait(timeout_s)
            return
        with WAKEUPS.waiting(self.spec.name, self.wake, self.gate.client):
            self.wake.wait(timeout_s)

    def _record_unrecorded(self) -> None:
        group, self.unrecorded = self.unrecorded, []
        if group:
            self._record(group)

    def _record(self, done: list[_Flight]) -> None:
        try:
            answered = [f for f in done if f.response is not None]
            for flight in answered:
                if self.quickest_s is None or flight.latency_s < self.quickest_s:
                    self.quickest_s = flight.latency_s
            recorded = self._group_commit(answered)
            for flight in done:
                if flight.response is not None:
                    self._answered(flight, recorded.get(flight.call.item.item_id, False))
                elif flight.verdict is not None:
                    self._failed(flight)
        finally:
            for flight in done:
                flight.hold.close()  # idempotent: an outcome not recorded still lets go

    def _group_commit(self, answered: list[_Flight]) -> dict[int, bool]:
        """The answers in one statement (retried through an outage for as long as the
        first one's lease lasts); the batches left with nothing waiting are closed."""
        if not answered:
            return {}
        group = [(f.call.item, self._outcome(f), f.call.served) for f in answered]
        started_ns = time.time_ns()
        try:
            found = with_db_retries(
                answered[0].call.item,
                "recording a pack's results",
                lambda connection: record_answers(connection, group),
                scope=db.autocommit,
            )
        except Exception as exc:
            if not db.is_transient(exc):
                raise
            return {}  # each answer on its own, below, through its own retries
        money_settle.settle(
            [
                answered_row(item, outcome, spec)
                for item, outcome, spec in group
                if (got := found.get(item.item_id)) is not None and got.recorded
            ]
        )
        closing: dict[str, int] = {}
        for item, _, _ in group:
            got = found.get(item.item_id)
            if got is not None and got.recorded and not got.waiting:
                closing.setdefault(item.batch_id, item.item_id)
        for batch_id, item_id in closing.items():
            close_batch(batch_id, item_id)
        for flight in answered:
            got = found.get(flight.call.item.item_id)
            sending = flight.sending
            if got is not None and got.recorded and sending is not None:  # others: alone
                with contextlib.suppress(Exception):  # a span must not undo a recorded answer
                    tracing.ledgered_packed(
                        flight.trace,
                        started_ns,
                        functools.partial(call_info, flight.call, sending),
                        flight.call.item.created_at,
                        flight.latency_s,
                    )
        return {i: a.recorded for i, a in found.items()}

    @staticmethod
    def _outcome(flight: _Flight) -> CallOutcome:
        assert flight.sending is not None and flight.response is not None
        return outcome_of(flight.call, flight.sending, flight.response, flight.latency_s)

    def _answered(self, flight: _Flight, recorded: bool) -> None:
        assert flight.sending is not None and flight.response is not None
        call = flight.call
        if not recorded:  # not the common case: the general path sorts it out, alone
            answer = self._outcome(flight)
            with tracing.inside(flight.trace):
                recorded = tracing.ledgered(
                    lambda: _record(call.item, answer, call.served),
                    functools.partial(call_info, call, flight.sending),
                    call.item.created_at,
                    flight.latency_s,
                )
        flight.hold.close()
        log_answer(call, flight.sending, flight.response, flight.latency_s, recorded)
        outcome = "succeeded" if recorded else "duplicate"
        self.done(flight.entry, Verdict(outcome, model=self.spec.name, call_s=flight.latency_s))

    def _failed(self, flight: _Flight) -> None:
        verdict = flight.verdict
        assert verdict is not None
        flight.hold.close()
        verdict = replace(verdict, model=self.spec.name)
        if verdict.ticket is not None:  # failed over: its next attempt goes out at once
            self.pack.handed_back.append(
                PackItem(flight.entry.item_id, verdict.ticket.to_message())
            )
        elif verdict.countdown_s is not None:  # a 429: it waits with the pack's rest
            self.pack.wait_with(flight.entry, verdict.countdown_s)
        self.pack.verdicts[flight.entry.item_id] = verdict
        self.note(verdict)

    def settle_unsent(self) -> None:
        """Settle the entries that were not claimed (nothing sent)."""
        unsent, self.unsent = self.unsent, []
        for admitted, ticket in unsent:
            _settle(self.gate, self.spec, admitted, ticket, Settlement())

    def _settle(self, done: list[_Flight]) -> None:
        """One script call for the calls that were sent; an unsent one alone (it may give
        back an adopted reservation differently). A Redis error must not undo the
        calls' outcomes: the reservations age out. The packs of this process waiting
        for a slot are woken."""
        # In the order their answers came: a bucket's level and learned ratio read
        # each answer's headers against the one before (budget_settle.lua).
        sent = sorted((f for f in done if f.settlement.error is not NOT_SENT), key=_heard_at)
        for flight in done:
            if flight.settlement.error is NOT_SENT:
                _settle(
                    self.gate, self.spec, flight.admitted, flight.call.ticket, flight.settlement
                )
        try:
            self.gate.settle_many(
                self.spec,
                [
                    Settling(
                        f.admitted,
                        f.call.ticket.tenant_id,
                        f.call.ticket.max_tokens,
                        f.settlement.response,
                        None if f.settlement.response is not None else f.settlement.error,
                        f.settlement.cut_by_deadline,
                    )
                    for f in sent
                ],
                then=[WAKEUPS.announcement(self.spec.name, len(done))] if self.overlap else (),
            )
        except redis.RedisError:
            log.warning("a pack's %d calls: Redis error settling; reservations age out", len(sent))
        else:
            WAKEUPS.freed(self.spec.name, len(done))


def _heard_at(flight: _Flight) -> float:
    """When the provider's answer (or its refusal) to ``flight`` came back."""
    response = flight.settlement.response
    state = getattr(response, "rate_limits", None) or getattr(
        flight.settlement.error, "rate_limits", None
    )
    received_s = getattr(state, "received_s", None)
    return received_s if isinstance(received_s, float) else flight.landed_s


def _send(flight: _Flight) -> None:
    """The provider call of one flight (on a call thread, or inline); a failure is
    applied at once (:func:`batchgen.worker.execution.call_failed`). What else it
    raises (a database outage applying a failure) is kept for the pack to raise once
    the others have landed."""
    assert flight.sending is not None
    settlement = flight.settlement
    started = time.monotonic()
    settlement.error = MAYBE_SENT
    try:
        with tracing.inside(flight.trace):  # its call's span (and failure's) in its trace
            try:
                sending = flight.sending
                described = functools.partial(call_info, flight.call, sending)
                response = tracing.called(described, flight.provider.complete, sending.request)
            except ProviderError as exc:
                settlement.error = exc
                call_s = time.monotonic() - started
                flight.landed_s = time.monotonic()
                flight.verdict = call_failed(
                    flight.call, flight.sending, flight.settings, exc, call_s
                )
                return
    except BaseException as exc:  # noqa: BLE001 - raised by the pack, in its thread
        flight.raised = exc
        return
    settlement.response, settlement.error = response, None
    flight.response = response
    flight.landed_s = time.monotonic()
    flight.latency_s = flight.landed_s - started
