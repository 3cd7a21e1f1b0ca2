"""The sweep: expired deadlines, lost messages, dead workers, batches left open.

Postgres is the truth, so recovering from a lost broker message, a flushed
Redis or a SIGKILLed worker is one UPDATE on leases that ran out. A lost
attempt whose request had been sent may be billed by the provider: it is
ledgered as waste in the same transaction (see :func:`batchgen.store.ledger.record_lost_call`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.registry import Registry, get_registry
from batchgen.store.batches import refresh_status
from batchgen.store.ledger import record_lost_call
from batchgen.store.sqlfiles import query

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepReport:
    expired: int
    requeued: int
    failed: int
    batches_finished: int


def attempt_caps(registry: Registry, settings: Settings) -> dict[str, int]:
    """Each model's attempt cap: its own, never above the global one (pure)."""
    return {spec.name: min(spec.max_attempts, settings.max_attempts) for spec in registry}


def sweep(session: Session, settings: Settings, registry: Registry | None = None) -> SweepReport:
    """One sweep pass in the caller's transaction."""
    registry = registry or get_registry()
    session.execute(query("sweep_cancel_orphans"))
    expired = list(session.execute(query("sweep_expire")).scalars())
    recovered = list(
        session.execute(
            query("sweep_requeue_lost"),
            {
                "max_attempts": settings.max_attempts,
                "attempt_caps": json.dumps(attempt_caps(registry, settings)),
            },
        )
    )
    for lost in recovered:
        if lost.was_sent:
            record_lost_call(session, lost.id, lost.attempts, registry)
    requeued = sum(1 for r in recovered if r.status == "pending")
    failed = sum(1 for r in recovered if r.status == "failed")
    expired_count = len(expired) + sum(1 for r in recovered if r.status == "expired")
    finished = 0
    for (batch_id,) in session.execute(query("unfinished_batches")).all():
        refresh_status(session, batch_id)
        finished += 1
    report = SweepReport(expired_count, requeued, failed, finished)
    if any((report.expired, report.requeued, report.failed, report.batches_finished)):
        log.info(
            "sweep expired=%d requeued=%d failed=%d batches_finished=%d",
            report.expired,
            report.requeued,
            report.failed,
            report.batches_finished,
        )
    return report
