"""The sweep: expired deadlines, lost messages, dead workers, batches left open.

Postgres is the truth, so recovering from a lost broker message, a flushed
Redis or a SIGKILLed worker is one UPDATE on leases that ran out. A lost
attempt whose request had been sent may be billed by the provider: it is
ledgered as waste in the same transaction
(:func:`batchgen.store.ledger.record_lost_call`), with the usage its stream
reported where that was kept in Redis, else with what it reserved.

A synchronous call whose caller no longer waits (the API process it ran in died)
is taken back as soon as its caller's presence lapses
(``BATCHGEN_CALLER_LEASE_S``), not when its running lease runs out, if that
process ran its attempt itself: what it cost is in the ledger within about that
time, and its slot is freed. An attempt a worker runs is left to its lease.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain.formats.stream_usage import ReportedUsage
from batchgen.domain.lifecycle.decisions import attempt_cap
from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.limits import liveness
from batchgen.limits.backend import get_redis
from batchgen.limits.concurrency import Slots
from batchgen.limits.gate import free_slot, slot_holder
from batchgen.registry import Registry, get_registry
from batchgen.store import batch_notifications, batches, files, items
from batchgen.store.ledger import record_lost_call
from batchgen.worker import money_settle

log = logging.getLogger(__name__)
money_settle.install()  # each ledger write settles its call's dollar reservation


@dataclass(frozen=True)
class SweepReport:
    expired: int
    requeued: int
    failed: int
    batches_finished: int
    files_deleted: int = 0


def attempt_caps(registry: Registry, settings: Settings) -> dict[str, int]:
    """Each model's attempt cap: its own, never above the global one (pure)."""
    return {
        spec.name: attempt_cap(spec.max_attempts, settings.worker.max_attempts) for spec in registry
    }


def _alive_owners(session: Session) -> set[int]:
    """Running items whose lease ran out although their worker's heartbeat in Redis is
    live (PostgreSQL was away longer than the lease): not lost, left to their owner.
    Redis unreachable: every such item counts as alive for this pass (a duplicate call
    would be paid; a later pass takes back what is really lost)."""
    ran_out = items.leases_ran_out(session)
    if not ran_out:
        return set()
    try:
        alive = liveness.alive(get_redis(), ran_out)
    except redis.RedisError:
        log.warning("sweep: Redis unreachable; %d running items kept for now", len(ran_out))
        return {item_id for item_id, _ in ran_out}
    if alive:
        log.info("sweep: %d running items past their lease have a live owner", len(alive))
    return alive


def _callers_gone(session: Session, caller_lease_s: float) -> dict[int, int]:
    """Synchronous calls whose caller no longer waits (the API process it waited in
    died), each with the attempt seen so: cancelled, not handed on, once their lease
    ran out; or at once when that process ran their attempt itself (its runner is gone
    with the caller; a worker's attempt is left to its lease). An attempt begun since
    (a worker's claim) is not touched. Redis unreachable: none."""
    checked = items.calls_to_check(session, caller_lease_s)
    if not checked:
        return {}
    try:
        client = get_redis()
        waiting = liveness.callers_waiting(client, [c.item_id for c in checked])
        gone = [c for c in checked if c.item_id not in waiting]
        early = [(c.item_id, c.attempt) for c in gone if not c.ran_out]
        run_here = liveness.run_by_caller(client, early)
    except redis.RedisError:
        return {}
    return {c.item_id: c.attempt for c in gone if c.ran_out or c.item_id in run_here}


def _never_left(lost: list[items.LostAttempt]) -> set[int]:
    """Of the attempts marked sent, those whose worker lost its claim's reply and so
    sent nothing (:func:`batchgen.worker.execution._mark_unsent`). Redis unreachable:
    none (a waste row too many, never a paid call missing)."""
    sent = [(a.item_id, a.claim_token) for a in lost if a.was_sent and a.claim_token]
    if not sent:
        return set()
    try:
        return liveness.unsent(get_redis(), sent)
    except Exception as exc:  # noqa: BLE001
        log.warning("sweep: cannot read unsent claims (%s)", type(exc).__name__)
        return set()


def _reported_usage(lost: list[items.LostAttempt]) -> dict[int, ReportedUsage]:
    """Of the attempts marked sent, the usage their stream reported before their process
    died (:func:`batchgen.worker.execution._keeping_usage`). Redis unreachable: none
    (their rows hold what they reserved, marked as estimates)."""
    sent = [(a.item_id, a.attempts) for a in lost if a.was_sent]
    if not sent:
        return {}
    try:
        kept = liveness.kept_usage(get_redis(), sent)
    except Exception as exc:  # noqa: BLE001
        log.warning("sweep: cannot read kept usage (%s)", type(exc).__name__)
        return {}
    return {item_id: ReportedUsage.from_json(usage) for item_id, usage in kept.items()}


def _free_slot(registry: Registry, attempt: items.LostAttempt) -> None:
    """A call whose caller is gone (its API process died) holds its model's slot until the
    slot's lease ends, as long as the running lease: freed now that the call is taken
    back, so the model's other work need not wait for it."""
    spec = registry.get(attempt.model)
    if spec is not None:
        free_slot(Slots(get_redis()), spec, slot_holder(attempt.item_id, attempt.attempts))


def sweep(session: Session, settings: Settings, registry: Registry | None = None) -> SweepReport:
    """One sweep pass in the caller's transaction."""
    registry = registry or get_registry()
    items.sweep_cancel_orphans(session)
    expired = items.sweep_expire(session)
    alive = _alive_owners(session)
    caps = attempt_caps(registry, settings)
    gone = _callers_gone(session, settings.calls.caller_lease_s)
    lost = items.sweep_lost(
        session,
        settings.worker.max_attempts,
        caps,
        alive=alive,
        callers_gone={i: a for i, a in gone.items() if i not in alive},
    )
    never_left = _never_left(lost)
    reported = _reported_usage(lost)
    for attempt in lost:
        log.info(
            "item %d: its %s lease ran out on attempt %d (request sent: %s); now %s",
            attempt.item_id,
            attempt.lease,
            attempt.attempts,
            "yes" if attempt.was_sent else "no",
            attempt.status.value,
        )
        if attempt.was_sent and attempt.item_id in never_left:
            log.info(
                "item %d: attempt %d never left its worker: no waste",
                attempt.item_id,
                attempt.attempts,
            )
        elif attempt.was_sent:
            usage = reported.get(attempt.item_id)
            record_lost_call(session, attempt.item_id, attempt.attempts, registry, usage)
        if gone.get(attempt.item_id) == attempt.attempts and attempt.lease == "running":
            _free_slot(registry, attempt)
    files_deleted = files.delete_expired(session)
    batch_notifications.delete_old(session, settings.webhooks.notification_retention_s)
    finished = 0
    for batch_id in batches.unfinished_batch_ids(session):
        batches.refresh_status(session, batch_id)
        finished += 1
    report = SweepReport(
        expired=expired + sum(1 for a in lost if a.status is ItemStatus.EXPIRED),
        requeued=sum(1 for a in lost if a.status is ItemStatus.PENDING),
        failed=sum(1 for a in lost if a.status is ItemStatus.FAILED),
        batches_finished=finished,
        files_deleted=files_deleted,
    )
    if any(vars(report).values()):
        log.info(
            "sweep expired=%d requeued=%d failed=%d batches_finished=%d files_deleted=%d",
            report.expired,
            report.requeued,
            report.failed,
            report.batches_finished,
            report.files_deleted,
        )
    return report
