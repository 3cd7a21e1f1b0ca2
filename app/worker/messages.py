"""One ``batchgen.generate`` message, run: its item, or a pack of a model's items when its
calls are short (:mod:`batchgen.worker.packs`), with what the process keeps between
messages (the gate, the cancel watcher, the calls' pace, the refiller). The task in
:mod:`batchgen.tasks.generate` only hands the message over and, when items wait,
retries itself with what :func:`run_message` says.

A message carries item ids, the model's name (which routes it to the model group's
queue) and each item's ticket (batch, tenant, attempt, token counts: ids and numbers,
never text).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from dataclasses import dataclass
from typing import Any

from batchgen.config import Settings, get_settings
from batchgen.domain.lifecycle.decisions import (
    calls_overlap,
    pack_size,
    refill_at_once_after,
    round_size,
    split_into_packs,
    together_pack_size,
)
from batchgen.errors import ItemFailed
from batchgen.limits.backend import get_redis
from batchgen.limits.gate import Gate
from batchgen.registry import ModelSpec, get_registry
from batchgen.store import db, items
from batchgen.store.items import Ticket
from batchgen.worker import publish
from batchgen.worker.cancellation import CancelWatcher
from batchgen.worker.dispatch import dispatch
from batchgen.worker.execution import run_item
from batchgen.worker.gate_recovery import checked_gate
from batchgen.worker.pack_calls import run_together
from batchgen.worker.packs import (
    CallPace,
    PackItem,
    PackOutcome,
    hold,
    message_of,
    pack_wait_s,
    read_pack,
    run_pack,
)
from batchgen.worker.refill import Refiller
from batchgen.worker.verdict import Verdict

log = logging.getLogger("batchgen.tasks.generate")


@functools.cache
def _gate() -> Gate:
    return checked_gate(get_redis(), get_settings())


@functools.cache
def _watcher() -> CancelWatcher:
    return CancelWatcher(get_redis())


@functools.cache
def _pace() -> CallPace:
    return CallPace()


def _pack_plan(model: str) -> tuple[int, bool]:
    """Items per message for ``model``'s refills, and whether their calls overlap."""
    settings = get_settings()
    pace = _pace().call_s(model)
    if not settings.packs.calls_together:
        return pack_size(pace, settings.packs.target_s, settings.packs.max_items), False
    spec = get_registry().get(model)
    cap = spec.max_concurrency if spec is not None else 1
    return together_pack_size(
        pace,
        settings.packs.target_s,
        settings.packs.max_items,
        cap,
        short_items=settings.packs.short_items,
        max_s=settings.packs.max_s,
    )


def _pack_items(model: str) -> int:
    return _pack_plan(model)[0]


def _overlapping(model: str) -> bool:
    return _pack_plan(model)[1]


def release(models: frozenset[str] | None = None) -> int:
    """Release what fits now (every model, or only ``models``) in packs of the size this
    process's pace of each model says (before its first call here, overlapping packs of
    at most a quarter of its slots: :func:`together_pack_size`); returns how many items."""
    return dispatch(
        get_registry(), get_settings(), models, pack_items=_pack_items, overlapping=_overlapping
    )


def _refill_at_once_after(model: str) -> int:
    spec, settings = get_registry().get(model), get_settings()
    if spec is None:  # not in this registry: the coalescing wait only
        return sys.maxsize
    items, overlap = _pack_plan(model)
    return refill_at_once_after(
        spec.max_concurrency, settings.worker.dispatch_ahead_factor, 1 if overlap else items
    )


@functools.cache
def _refiller() -> Refiller:
    return Refiller(release, get_settings().worker.refill_coalesce_s, _refill_at_once_after)


@dataclass(frozen=True)
class Retry:
    """The message to run again after ``countdown_s``: its first item and the rest."""

    item_id: int
    kwargs: dict[str, Any]
    countdown_s: float | None


@dataclass(frozen=True)
class Ran:
    """A message's end: a summary of what ran, or the items that wait (a retry)."""

    summary: str
    retry: Retry | None = None


def run_message(
    item_id: int,
    model: str | None,
    ticket: dict[str, Any] | None,
    more: list[Any] | None,
) -> Ran:
    """Run item ``item_id``, then the items of ``more`` (``[[id, ticket], ...]``, a pack).
    A ``ticket`` lets the gate decide before the claim (a message without one, or with
    one this version cannot read, costs a lookup of the item). Raises what an item
    raised, and :class:`ItemFailed` when items failed for good."""
    registry, settings = get_registry(), get_settings()
    pack = read_pack(item_id, ticket, more)

    def note(verdict: Verdict) -> None:
        if verdict.model is not None:
            if verdict.call_s is not None:
                _pace().note(verdict.model, verdict.call_s)
            if verdict.frees_place:
                # A place in the model's window freed: refill it soon, without waiting
                # for the tick.
                _refiller().note(verdict.model)

    def run_one(item: PackItem) -> Verdict:
        read: Ticket | None = None
        if item.ticket is not None:
            with contextlib.suppress(ValueError):
                read = Ticket.from_message(item.item_id, item.ticket)
        verdict = run_item(
            item.item_id, registry, settings, _gate(), _watcher(), model=model, ticket=read
        )
        note(verdict)
        return verdict

    spec = registry.get(model) if model else None
    tickets = _together(pack, spec, settings)
    if spec is not None and tickets is not None:
        pace, packs = _pace().call_s(spec.name), settings.packs
        overlap = calls_overlap(pace, packs.target_s, len(pack))
        rounds = round_size(pace, packs.max_s, packs.max_items, packs.short_items)
        outcome = run_together(
            pack, spec, tickets, settings, _gate(), _watcher(), overlap, note, rounds
        )
    else:
        outcome = run_pack(pack, run_one, settings.packs.max_s)
    if outcome.handed_back:
        # A group of short calls that ran out of time hands its rest back in packs of
        # the size a refill would make now (its calls turned slow: small ones).
        packed = spec is not None and tickets is not None and outcome.error is None
        size = _pack_items(spec.name) if packed and spec is not None else 1
        lease_s = settings.worker.queued_lease_s
        if size > 1 and spec is not None:  # as a refill's packed items' (dispatch.py)
            lease_s += pack_wait_s(spec, settings)
        _hand_back(outcome, model, len(pack), item_id, settings, size, lease_s)
    if outcome.error is not None:
        raise outcome.error
    if outcome.waiting:
        first, ticket_of_first, rest = message_of(outcome.waiting)
        if rest:
            log.info(
                "pack of %d items: item %d waits %.2f s with %d more",
                len(pack),
                first,
                outcome.countdown_s,
                len(rest),
            )
            hold(outcome.waiting[1:], (outcome.countdown_s or 0.0) + settings.worker.queued_lease_s)
        kwargs = {"model": model, "ticket": ticket_of_first, "more": rest}
        return Ran(outcome.summary(), Retry(first, kwargs, outcome.countdown_s))
    ran = zip(outcome.ran_ids(pack), outcome.verdicts, strict=True)
    failed = [item_id for item_id, v in ran if v.outcome == "failed"]
    if failed:
        with db.autocommit() as connection:
            codes = [items.error_code_of(connection, i) or "failed" for i in failed]
        raise ItemFailed(
            "; ".join(f"item {i} failed: {code}" for i, code in zip(failed, codes, strict=True))
        )
    return Ran(outcome.summary())


def _together(
    pack: list[PackItem], spec: ModelSpec | None, settings: Settings
) -> list[Ticket] | None:
    """The pack's tickets when it runs as a group (:mod:`batchgen.worker.pack_calls`):
    more than one item, of a model in the registry, every ticket readable and none a
    synchronous call's; otherwise None (one after another, each as alone)."""
    if not settings.packs.calls_together or len(pack) < 2 or spec is None:
        return None
    tickets: list[Ticket] = []
    for item in pack:
        if item.ticket is None:
            return None
        try:
            ticket = Ticket.from_message(item.item_id, item.ticket)
        except ValueError:
            return None
        if ticket.urgent:
            return None
        tickets.append(ticket)
    return tickets


def _hand_back(
    outcome: PackOutcome,
    model: str | None,
    size: int,
    item_id: int,
    settings: Settings,
    pack_items: int = 1,
    lease_s: float | None = None,
) -> None:
    """The pack's untried items go to other threads, one per message (or in packs of
    ``pack_items``; a failed-over item always alone): its calls turned slow, an item
    raised, or items failed over to another deployment (each with its next ticket).
    Best effort: an item whose message is lost waits for the sweep."""
    failed_over = sum(1 for p in outcome.handed_back if (p.ticket or {}).get("avoid"))
    why = f"ran past {settings.packs.max_s} s"
    if outcome.error is not None:
        why = "an item failed"
    elif failed_over == len(outcome.handed_back):
        why = "failed over to another deployment"
    log.info(
        "pack of %d items from item %d %s: %d items handed back",
        size,
        item_id,
        why,
        len(outcome.handed_back),
    )
    if model is None:
        return
    try:
        hold(outcome.handed_back, lease_s or settings.worker.queued_lease_s)
        packs = split_into_packs(
            outcome.handed_back, pack_items, alone=lambda p: bool((p.ticket or {}).get("avoid"))
        )
        messages = []
        for each in packs:
            first, ticket, more = message_of(each)
            messages.append((first, model, ticket, more))
        publish.generate_many(messages)
    except Exception as exc:
        if outcome.error is None:
            raise
        log.warning("handing back a pack's items failed (%s); the sweep will", exc)
