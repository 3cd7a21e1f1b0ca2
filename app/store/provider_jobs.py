"""Provider jobs in PostgreSQL: the jobs of the providers' own Batch APIs that hold
offloaded items (``provider_jobs``, ``provider_job_items``).

A job is recorded with its items in one transaction *before* the call that creates
it at the provider (``creating``); the provider's id is recorded after. A job found
``creating`` by the next tick had its create answer lost: the tick looks for it at
the provider by its ``tag`` (:mod:`batchgen.worker.offload_jobs`). The items' own moves
go through :mod:`batchgen.store.items`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from batchgen.domain.lifecycle.status import OPEN_JOBS, JobStatus, values
from batchgen.domain.scheduling.offload import Row
from batchgen.store import items
from batchgen.store.schema import Batch, ProviderJob, ProviderJobItem

OPEN_JOB_VALUES = values(OPEN_JOBS)  # type: ignore[arg-type]


def new_tag() -> str:
    """A job's name at the provider (the prefix of its requests' ``custom_id``)."""
    return "bgj" + uuid.uuid4().hex[:20]


@dataclass(frozen=True)
class JobRecord:
    id: int
    tag: str
    model: str
    batch_id: str
    status: JobStatus
    provider_job_id: str | None
    item_count: int
    enqueued_tokens: int
    cutoff_at: dt.datetime
    created_at: dt.datetime
    polls: int
    cancel_sent_at: dt.datetime | None
    cancel_reason: str | None


def _record(job: ProviderJob) -> JobRecord:
    return JobRecord(
        id=job.id,
        tag=job.tag,
        model=job.model,
        batch_id=job.batch_id,
        status=JobStatus(job.status),
        provider_job_id=job.provider_job_id,
        item_count=job.item_count,
        enqueued_tokens=job.enqueued_tokens,
        cutoff_at=job.cutoff_at,
        created_at=job.created_at,
        polls=job.polls,
        cancel_sent_at=job.cancel_sent_at,
        cancel_reason=job.cancel_reason,
    )


def now(session: Session) -> dt.datetime:
    value = session.scalar(select(func.now()))
    assert value is not None
    return value


def record_job(
    session: Session, *, model: str, batch_id: str, rows: Sequence[Row], cutoff_at: dt.datetime
) -> tuple[JobRecord, dict[int, int]] | None:
    """Record a new job (``creating``) holding ``rows``' items, in the caller's
    transaction; returns it and ``{item id: attempt}``, or None when none of the
    items was still waiting."""
    job = ProviderJob(
        tag=new_tag(),
        model=model,
        batch_id=batch_id,
        status=JobStatus.CREATING.value,
        item_count=0,
        enqueued_tokens=0,
        size_bytes=0,
        cutoff_at=cutoff_at,
        polls=0,
    )
    session.add(job)
    session.flush()
    attempts = items.assign_job(session, job.id, [r.item_id for r in rows])
    if not attempts:
        session.delete(job)
        session.flush()
        return None
    taken = [r for r in rows if r.item_id in attempts]
    job.item_count = len(taken)
    job.enqueued_tokens = sum(r.tokens for r in taken)
    job.size_bytes = sum(r.size_bytes for r in taken)
    session.execute(
        insert(ProviderJobItem),
        [{"job_id": job.id, "item_id": r.item_id, "attempt": attempts[r.item_id]} for r in taken],
    )
    session.flush()
    session.refresh(job)
    return _record(job), attempts


def get(session: Session, job_id: int) -> JobRecord:
    job = session.get(ProviderJob, job_id)
    assert job is not None
    return _record(job)


def attempts_of(session: Session, job_id: int) -> dict[int, int]:
    """``{item id: attempt}`` of every item the job holds."""
    rows = session.execute(
        select(ProviderJobItem.item_id, ProviderJobItem.attempt).where(
            ProviderJobItem.job_id == job_id
        )
    )
    return {r.item_id: r.attempt for r in rows}


def _set(session: Session, job_id: int, **values: object) -> None:
    session.execute(
        update(ProviderJob)
        .where(ProviderJob.id == job_id)
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def mark_created(session: Session, job_id: int, provider_job_id: str, first_poll_s: float) -> None:
    """The provider has the job: its id, and when to look at it first."""
    _set(
        session,
        job_id,
        status=JobStatus.RUNNING.value,
        provider_job_id=provider_job_id,
        submitted_at=func.now(),
        next_poll_at=func.now() + dt.timedelta(seconds=first_poll_s),
    )


def mark(session: Session, job_id: int, status: JobStatus, error_code: str | None = None) -> None:
    """A job's new status (ended, failed, abandoned: finished now)."""
    values: dict[str, object] = {"status": status.value}
    if status not in OPEN_JOBS:
        values["finished_at"] = func.now()
    if error_code is not None:
        values["error_code"] = error_code
    _set(session, job_id, **values)


def schedule_poll(session: Session, job_id: int, delay_s: float) -> None:
    _set(
        session,
        job_id,
        polls=ProviderJob.polls + 1,
        next_poll_at=func.now() + dt.timedelta(seconds=delay_s),
    )


def mark_cancel_sent(session: Session, job_id: int, reason: str) -> None:
    _set(session, job_id, cancel_sent_at=func.now(), cancel_reason=reason)


def _open(session: Session, *where: Any) -> list[JobRecord]:
    query = (
        select(ProviderJob)
        .where(ProviderJob.status.in_(OPEN_JOB_VALUES), *where)
        .order_by(ProviderJob.id)
    )
    return [_record(j) for j in session.scalars(query)]


def open_jobs(session: Session, model: str | None = None) -> list[JobRecord]:
    return _open(session, *([] if model is None else [ProviderJob.model == model]))


def unsettled(session: Session) -> list[JobRecord]:
    """Jobs whose create answer is not recorded (``creating`` found by the next tick:
    the tick that created it died) or whose provider id is still unknown."""
    return _open(
        session,
        ProviderJob.status.in_([JobStatus.CREATING.value, JobStatus.UNCONFIRMED.value]),
    )


def cancel_wanted(session: Session) -> list[JobRecord]:
    """Open jobs of cancelled batches not yet cancelled at the provider."""
    return _open(
        session,
        ProviderJob.cancel_sent_at.is_(None),
        ProviderJob.batch_id.in_(select(Batch.id).where(Batch.cancel_requested_at.is_not(None))),
    )


def late(session: Session) -> list[JobRecord]:
    """Open jobs past their cutoff not yet cancelled at the provider."""
    return _open(session, ProviderJob.cancel_sent_at.is_(None), ProviderJob.cutoff_at <= func.now())


def due(session: Session) -> list[JobRecord]:
    """Running jobs whose next poll is due."""
    return _open(
        session,
        ProviderJob.status == JobStatus.RUNNING.value,
        ProviderJob.next_poll_at <= func.now(),
    )


def enqueued_tokens(session: Session, model: str) -> int:
    """Tokens the model's open jobs hold at the provider (its enqueued-token limit)."""
    value = session.scalar(
        select(func.coalesce(func.sum(ProviderJob.enqueued_tokens), 0)).where(
            ProviderJob.model == model, ProviderJob.status.in_(OPEN_JOB_VALUES)
        )
    )
    return int(value or 0)


@dataclass(frozen=True)
class OpenJobs:
    """A model's open provider jobs, for status and metrics."""

    model: str
    count: int
    items: int
    oldest_age_s: float


def summary(session: Session) -> list[OpenJobs]:
    rows = session.execute(
        select(
            ProviderJob.model,
            func.count(),
            func.sum(ProviderJob.item_count),
            func.extract("epoch", func.now() - func.min(ProviderJob.created_at)),
        )
        .where(ProviderJob.status.in_(OPEN_JOB_VALUES))
        .group_by(ProviderJob.model)
        .order_by(ProviderJob.model)
    )
    return [OpenJobs(r[0], int(r[1]), int(r[2] or 0), float(r[3] or 0)) for r in rows]
