"""Packs: one message carrying several items of one model.

By default a pack runs as a group (:mod:`batchgen.worker.pack_calls`: one gate
script call, one claim statement, one record statement and one settle call for its
items, whose calls overlap when they are slow). This module holds what both ways
share (a pack read from its message, its outcome, the hold on its waiting items,
the calls' pace) and the other way, ``BATCHGEN_PACK_CALLS_TOGETHER=false``: the
items one after another, each as a message of its own would run.

Celery spends about as much CPU on a message (reading it, its three task events,
its ack) as batchgen spends on an item's own work. When a model's calls are short
that cost would decide the throughput, so a refill puts as many items in one
message as this process's recent calls of the model take ``pack_target_s``
together (:func:`batchgen.domain.lifecycle.decisions.pack_size`), at most
``pack_max_items``; with calls of a second or more a message carries one item,
as before.

A pack's items run in order on one worker thread, each exactly as a message of its
own would run (:func:`batchgen.worker.execution.run_item`: its gate, its claim,
its call, its record). Two things are decided for the pack as a whole:

* a wait (a model's slots, budget or cooldown: a ``countdown``) holds the item
  that met it *and the untried rest*, which would meet the same wait: they go
  back to the broker together, as the message's retry after that countdown;
* a pack that has run ``pack_max_s`` (its calls turned slow) hands its untried
  items back at once, one per message, so that other threads take them.

The untried items stay ``queued`` with their leases meanwhile: a worker that dies
mid-pack loses none of them (the message is delivered again, or the sweep hands
them back when their leases run out), and an item's claim still matches one
delivery only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchgen.config import Settings
from batchgen.limits.gate import running_lease_s
from batchgen.registry import ModelSpec
from batchgen.store import db, items
from batchgen.worker.verdict import Verdict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackItem:
    """One item of a message: its id and its ticket as the message carries it
    (:meth:`batchgen.store.items.Ticket.to_message`; None in an old message)."""

    item_id: int
    ticket: dict[str, Any] | None

    @property
    def attempt(self) -> int | None:
        """The attempt this delivery would make (from the ticket), if it says."""
        value = (self.ticket or {}).get("attempt")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_pack(item_id: int, ticket: dict[str, Any] | None, more: Any) -> list[PackItem]:
    """The items of a message: its own, then those of ``more`` (``[[id, ticket], ...]``).
    An entry of ``more`` that is not of that form is left out and logged: its item
    stays queued until its lease runs out and the sweep hands it back."""
    pack = [PackItem(int(item_id), ticket)]
    if more is None:
        return pack
    if not isinstance(more, list | tuple):
        log.warning("item %d: a message's other items are unreadable, left to the sweep", item_id)
        return pack
    for entry in more:
        try:
            other_id, other_ticket = entry
            if other_ticket is not None and not isinstance(other_ticket, dict):
                raise TypeError("ticket")
            pack.append(PackItem(int(other_id), other_ticket))
        except (TypeError, ValueError):
            log.warning("item %d: an unreadable entry of its message, left to the sweep", item_id)
    return pack


def message_of(pack: Sequence[PackItem]) -> tuple[int, dict[str, Any] | None, list[Any] | None]:
    """``pack`` as a message's (item id, ticket, more): :func:`read_pack`'s inverse."""
    first, rest = pack[0], pack[1:]
    return first.item_id, first.ticket, [[p.item_id, p.ticket] for p in rest] or None


def pack_wait_s(spec: ModelSpec, settings: Settings) -> float:
    """How long an item may wait in its pack before it is run or handed back: the pack's
    time, then one more item's gate (its slot wait) and call (its running lease). A
    packed item's queued lease is this much longer."""
    return settings.packs.max_s + settings.worker.slot_wait_s + running_lease_s(spec, settings)


def hold(pack: Sequence[PackItem], lease_s: float) -> None:
    """The untried items of a pack that waits or is handed back keep their places:
    their queued leases last ``lease_s`` from now. Best effort: if the database cannot
    say, an item whose lease runs out is handed back by the sweep, and its claim still
    matches one delivery."""
    held = [(p.item_id, p.attempt) for p in pack if p.attempt is not None]
    try:
        with db.autocommit() as connection:
            items.hold_queued(connection, held, lease_s)
    except Exception as exc:
        if not db.is_transient(exc):
            raise
        log.warning("a pack's %d waiting items: leases not extended (%s)", len(held), exc)


@dataclass(frozen=True)
class PackOutcome:
    """What became of a message's items."""

    verdicts: list[Verdict]  # one per item run, in order
    # The item that met a wait and the untried rest: sent again after countdown_s.
    waiting: list[PackItem]
    countdown_s: float | None
    # Untried when the pack had run its time, or after an item's error: sent again at
    # once, one per message.
    handed_back: list[PackItem]
    # What an item raised (a database or Redis outage): the task raises it in turn.
    error: Exception | None = None
    # The ids of the items whose verdicts these are, in order, when that is not the
    # pack's first len(verdicts) items (a pack run as a group: worker/pack_calls.py).
    ran: list[int] | None = None

    def ran_ids(self, pack: Sequence[PackItem]) -> list[int]:
        """The item of each verdict, in order."""
        if self.ran is not None:
            return self.ran
        return [p.item_id for p in pack[: len(self.verdicts)]]

    def summary(self) -> str:
        """The task's result: an item's outcome, or a pack's outcomes counted."""
        if len(self.verdicts) == 1 and not self.waiting and not self.handed_back:
            return self.verdicts[0].outcome
        counts = Counter(v.outcome for v in self.verdicts)
        if self.handed_back:
            counts["handed back"] = len(self.handed_back)
        if len(self.waiting) > 1:
            counts["waiting"] = len(self.waiting) - 1  # the first is counted as "wait"
        return ", ".join(f"{outcome} {n}" for outcome, n in counts.items())


def run_pack(
    pack: Sequence[PackItem],
    run_one: Callable[[PackItem], Verdict],
    max_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> PackOutcome:
    """Run ``pack``'s items in order with ``run_one``, until one must wait (it and the
    rest wait together), ``max_s`` has passed or an item raised (the rest are handed
    back). An item whose call failed over to another deployment (its verdict carries
    its next ticket) is handed back at once with that ticket, and the rest runs on:
    they would not meet its failure."""
    started = clock()
    verdicts: list[Verdict] = []
    passed_on: list[PackItem] = []
    for index, item in enumerate(pack):
        if index and clock() - started >= max_s:
            return PackOutcome(verdicts, [], None, passed_on + list(pack[index:]))
        try:
            verdict = run_one(item)
        except Exception as exc:  # the item's own delivery fails as alone; the rest go on
            rest = passed_on + list(pack[index + 1 :])
            return PackOutcome(verdicts, [], None, rest, error=exc)
        verdicts.append(verdict)
        next_try = None
        if verdict.ticket is not None:  # the next delivery is another attempt
            next_try = PackItem(item.item_id, verdict.ticket.to_message())
            if index + 1 < len(pack):
                passed_on.append(next_try)
                continue
        if verdict.countdown_s is not None:
            waiting = [next_try or item, *pack[index + 1 :]]
            return PackOutcome(verdicts, waiting, verdict.countdown_s, passed_on)
    return PackOutcome(verdicts, [], None, passed_on)


class CallPace:
    """This process's recent call times per model, from which a refill sizes its packs.

    The pace is a low quantile (``QUANTILE``) of the last ``SAMPLES`` calls: under load,
    a call's time here includes the wait for this process's CPU (its threads share one
    interpreter lock), which says nothing of how long the provider takes; the quicker
    calls show that. A provider's 429 is not a call's time (it comes back at once);
    an error or a time-out is: a provider that turns slow or fails slowly shows here."""

    SAMPLES = 50
    QUANTILE = 0.1

    def __init__(self) -> None:
        self._recent: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def note(self, model: str, call_s: float) -> None:
        with self._lock:
            recent = self._recent.get(model)
            if recent is None:
                recent = self._recent[model] = deque(maxlen=self.SAMPLES)
            recent.append(call_s)

    def call_s(self, model: str) -> float | None:
        """The model's pace, or None before its first answered call here."""
        with self._lock:
            recent = sorted(self._recent.get(model, ()))
        if not recent:
            return None
        return recent[int(self.QUANTILE * (len(recent) - 1))]
