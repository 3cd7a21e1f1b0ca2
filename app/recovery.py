"""The sweep: expired deadlines, lost messages, dead workers, batches left open.

Postgres is the truth, so recovering from a lost broker message, a flushed
Redis or a SIGKILLed worker is one UPDATE on leases that ran out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.orm import Session

from app.batches import refresh_status
from app.config import Settings
from app.sqlfiles import query

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepReport:
    expired: int
    requeued: int
    failed: int
    batches_finished: int


def sweep(session: Session, settings: Settings) -> SweepReport:
    """One sweep pass in the caller's transaction."""
    session.execute(query("sweep_cancel_orphans"))
    expired = list(session.execute(query("sweep_expire")).scalars())
    recovered = list(
        session.execute(query("sweep_requeue_lost"), {"max_attempts": settings.max_attempts})
    )
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
