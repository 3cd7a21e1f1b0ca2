"""Incremental nightly runs (:mod:`batchgen.nightly`): each product's last description
and the request it was made from, and what each run served from those texts.

A run is recorded once, when it is first submitted (:func:`record_run`): the products
whose request has the SHA-256 of their stored description are reused, their text
copied for the run; the others are marked pending on the run's date. A second submit
of the same run replays that record. When the run is collected, its results become the
descriptions of the products still pending on it (:func:`store_descriptions`), and its
output is its results plus its reused texts (:func:`reused_descriptions`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, and_, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from batchgen.errors import Conflict
from batchgen.store import tenants
from batchgen.store.schema import NightlyProduct, NightlyReused, NightlyRun
from batchgen.store.sqlfiles import query

# Products forgotten per statement (each a bind parameter).
FORGET_ROWS = 5000


@dataclass(frozen=True)
class RunKey:
    """A run: a tenant's job on a day."""

    tenant_id: int
    job: str
    day: dt.date

    @classmethod
    def find(cls, session: Session, tenant: str, job: str, day: dt.date) -> RunKey:
        """The key of ``job`` of the tenant named ``tenant`` (:class:`NotFound` if none)."""
        return cls(tenants.find(session, tenant).id, job, day)

    def params(self) -> dict[str, object]:
        return {"tenant_id": self.tenant_id, "job": self.job, "run_date": self.day}


def _run_row(key: RunKey) -> ColumnElement[bool]:
    return and_(
        NightlyRun.tenant_id == key.tenant_id,
        NightlyRun.job == key.job,
        NightlyRun.run_date == key.day,
    )


def _reused_rows(key: RunKey) -> ColumnElement[bool]:
    return and_(
        NightlyReused.tenant_id == key.tenant_id,
        NightlyReused.job == key.job,
        NightlyReused.run_date == key.day,
    )


def _closed(key: RunKey) -> Conflict:
    return Conflict(
        f"nightly job {key.job}: the run of {key.day.isoformat()} is closed (its reused "
        "descriptions were dropped once a later run was collected)"
    )


def record_run(
    session: Session,
    key: RunKey,
    planned: Sequence[tuple[str, str]],
    known_ids: Sequence[str],
) -> tuple[dict[str, str], bool]:
    """Decide once which of the run's products are reused; returns ``(reused, created)``.

    ``planned``: the run's products, ``(product_id, request_sha256)`` in catalog
    order; ``known_ids``: every product id the catalog has (rejected rows' too).
    The first call for a run copies the texts of the products whose stored request has
    the same hash, forgets products no longer in the catalog, and marks the others
    pending on the run's date. A later call (the task firing twice) replays the first
    one's choice and marks the same products pending; ``created`` is False then.
    ``reused`` maps each reused product to its request hash.
    """
    ids = [p for p, _ in planned]
    created = (
        session.execute(
            insert(NightlyRun)
            .values(tenant_id=key.tenant_id, job=key.job, run_date=key.day)
            .on_conflict_do_nothing()
            .returning(NightlyRun.run_date)
        ).first()
        is not None
    )
    if created:
        _forget(session, key, set(known_ids))
        rows = session.execute(
            query("nightly_reuse"),
            {**key.params(), "product_ids": ids, "sha256s": [h for _, h in planned]},
        ).all()
        reused = {row.product_id: row.request_sha256 for row in rows}
        session.execute(update(NightlyRun).where(_run_row(key)).values(reused=len(reused)))
    else:
        reused = _recorded_reuse(session, key)
    pending = [(p, h) for p, h in planned if p not in reused]
    session.execute(
        query("nightly_pending"),
        {
            **key.params(),
            "product_ids": [p for p, _ in pending],
            "sha256s": [h for _, h in pending],
        },
    )
    return reused, created


def _forget(session: Session, key: RunKey, known_ids: set[str]) -> None:
    """Forget the job's products that are no longer in its catalog, texts and all (a
    set difference here, not an anti join that a fresh table's statistics would make
    compare every pair)."""
    of_job = (NightlyProduct.tenant_id == key.tenant_id, NightlyProduct.job == key.job)
    stored = session.scalars(select(NightlyProduct.product_id).where(*of_job))
    gone = sorted(set(stored) - known_ids)
    for start in range(0, len(gone), FORGET_ROWS):
        chunk = gone[start : start + FORGET_ROWS]
        session.execute(delete(NightlyProduct).where(*of_job, NightlyProduct.product_id.in_(chunk)))


def _recorded_reuse(session: Session, key: RunKey) -> dict[str, str]:
    count = session.scalar(select(NightlyRun.reused).where(_run_row(key)))
    reused = {
        product_id: sha256
        for product_id, sha256 in session.execute(
            select(NightlyReused.product_id, NightlyReused.request_sha256).where(_reused_rows(key))
        )
    }
    if len(reused) != count:
        raise _closed(key)
    return reused


def recorded_reuse(session: Session, key: RunKey) -> int | None:
    """How many products the run reused; ``None`` if the run was not recorded (a job
    that is not incremental) and :class:`Conflict` if their texts were dropped."""
    count = session.scalar(select(NightlyRun.reused).where(_run_row(key)))
    if count is None:
        return None
    kept = session.scalar(select(func.count()).select_from(NightlyReused).where(_reused_rows(key)))
    if kept != count:
        raise _closed(key)
    return int(count)


def store_descriptions(session: Session, key: RunKey, rows: Iterable[tuple[str, str]]) -> int:
    """The run's results ``(product_id, text)``: each becomes its product's description,
    unless a later run has submitted the product since. Returns how many did."""
    rows = list(rows)
    if not rows:
        return 0
    done = session.execute(
        query("nightly_describe"),
        {
            **key.params(),
            "product_ids": [p for p, _ in rows],
            "descriptions": [t for _, t in rows],
        },
    )
    return int(done.rowcount)  # type: ignore[attr-defined]


def reused_descriptions(session: Session, key: RunKey) -> Iterator[tuple[str, str]]:
    """The run's reused products and their texts, in catalog order."""
    rows = session.execute(
        select(NightlyReused.product_id, NightlyReused.description)
        .where(_reused_rows(key))
        .order_by(NightlyReused.position)
        .execution_options(yield_per=1000)
    )
    yield from rows


def close_run(session: Session, key: RunKey) -> None:
    """The run's output is written: drop the reused texts of the job's earlier runs that
    were collected too (nothing reads them again but a collect of those runs, which is
    then refused)."""
    session.execute(update(NightlyRun).where(_run_row(key)).values(collected_at=func.now()))
    earlier = select(NightlyRun.run_date).where(
        NightlyRun.tenant_id == key.tenant_id,
        NightlyRun.job == key.job,
        NightlyRun.run_date < key.day,
        NightlyRun.collected_at.is_not(None),
    )
    session.execute(
        delete(NightlyReused).where(
            NightlyReused.tenant_id == key.tenant_id,
            NightlyReused.job == key.job,
            NightlyReused.run_date.in_(earlier),
        )
    )
