"""Totals that cost the same however long the history: what ``/metrics``, the status
view and admission read instead of counting items one by one.

* ``admitted_totals``: items and estimated tokens per model and tenant, added by each
  submit in its own transaction (:func:`admit`).
* ``finished_totals``, ``batch_totals``, ``latency_totals``: finished items per model,
  tenant and status, per batch, and the results' latency histograms. They are rolled
  up off the hot path (:func:`roll_up`, from the sweep's beat and before retention)
  from ``items.finished_at``, up to a watermark ``ROLL_UP_LAG_S`` behind the
  database's clock; a reader adds the *tail*, the items finished at or after the
  watermark, read through ``ix_items_finished_at``. The cost of a read is the size of
  those small tables plus the items finished in the last few minutes.
* What is open is what was admitted less what finished: pending items are never
  counted one by one; queued and running ones (bounded by the concurrency windows)
  and offloaded ones are counted live.

The lag is the one assumption: an item's final transaction commits within
``ROLL_UP_LAG_S`` of its start (``finished_at`` is the transaction's ``now()``), so
no item finishes behind a watermark that has already passed it. The hot path's
transactions last milliseconds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, TextClause, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from batchgen.store.schema import AdmittedTotals, TotalsWatermark
from batchgen.store.sqlfiles import query

ROLL_UP_LAG_S = 300
# The latency histograms' bucket bounds (seconds): a queue wait or an upstream call of
# an LLM lies between 10 ms and 10 min.
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
LATENCY_BOUNDS_MS = [int(b * 1000) for b in LATENCY_BUCKETS_S]
# The +Inf bucket's bound in latency_totals (an integer column, so the largest one).
LE_INF_MS = 2_147_483_647
READ_ATTEMPTS = 5

Db = Session | Connection


@dataclass(frozen=True)
class Count:
    items: int = 0
    tokens_est: int = 0

    def __add__(self, other: Count) -> Count:
        return Count(self.items + other.items, self.tokens_est + other.tokens_est)


# (model, tenant_id, status) -> Count
Counts = dict[tuple[str, int, str], Count]


def admit(session: Db, tenant_id: int, admitted: dict[str, Count]) -> None:
    """Add a submit's items per model to the admitted totals (in its transaction)."""
    rows = [
        {"model": m, "tenant_id": tenant_id, "items": c.items, "tokens_est": c.tokens_est}
        for m, c in sorted(admitted.items())  # a fixed order: no deadlock between submits
        if c.items
    ]
    if not rows:
        return
    stmt = insert(AdmittedTotals).values(rows)
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=["model", "tenant_id"],
            set_={
                "items": AdmittedTotals.items + stmt.excluded["items"],
                "tokens_est": AdmittedTotals.tokens_est + stmt.excluded.tokens_est,
            },
        )
    )


def roll_up(session: Session, wait: bool = False, lag_s: float = ROLL_UP_LAG_S) -> bool:
    """Move the items finished since the watermark (up to ``ROLL_UP_LAG_S`` ago) into
    the rolled-up totals, in the caller's transaction. False when nothing is due, or
    when another process is rolling up and ``wait`` is False (then it is skipped; with
    ``wait``, as before a purge, the other one is waited for and the rest rolled up).
    ``lag_s`` below the default only where nothing is running (tests, a quiet moment)."""
    since = session.execute(
        select(TotalsWatermark.rolled_up_before)
        .where(TotalsWatermark.id == 1)
        .with_for_update(skip_locked=not wait)
    ).one_or_none()
    if since is None:
        return False
    until = session.scalar(text("SELECT now() - make_interval(secs => :lag_s)"), {"lag_s": lag_s})
    if since[0] is not None and until is not None and until <= since[0]:
        return False
    session.execute(
        query("totals_rollup"),
        {"since": since[0], "until": until, "bounds_ms": LATENCY_BOUNDS_MS},
    )
    return True


def _read(session: Db, statement: TextClause, params: dict[str, Any]) -> Sequence[Any]:
    """Rows of a totals query (rolled up + the tail since the watermark).

    The watermark is read first, so that the tail's index scan is planned for the
    few rows it holds; each row says which watermark its statement saw, and a
    roll-up that committed in between (the totals and the tail would overlap) makes
    the read start again."""
    for _ in range(READ_ATTEMPTS):
        since = session.scalar(
            select(TotalsWatermark.rolled_up_before).where(TotalsWatermark.id == 1)
        )
        rows = session.execute(statement, {**params, "since": since}).all()
        if all(row.watermark == since for row in rows):
            return rows
    raise RuntimeError(f"the totals' watermark moved during each of {READ_ATTEMPTS} reads")


def finished(session: Db) -> Counts:
    """Finished items and their estimated tokens per (model, tenant_id, status)."""
    return {
        (r.model, r.tenant_id, r.status): Count(int(r.items), int(r.tokens_est or 0))
        for r in _read(session, query("totals_finished"), {})
    }


def open_counts(
    session: Db, models: Iterable[str], model: str | None = None, tenant_id: int | None = None
) -> Counts:
    """Open items per (model, tenant_id, status), optionally of one model or tenant."""
    params = {"models": sorted(models), "model": model, "tenant_id": tenant_id}
    return {
        (r.model, r.tenant_id, r.status): Count(int(r.items), int(r.tokens_est or 0))
        for r in _read(session, query("totals_open"), params)
    }


def total(counts: Counts, statuses: Iterable[str] | None = None) -> Count:
    wanted = None if statuses is None else set(statuses)
    result = Count()
    for (_, _, status), count in counts.items():
        if wanted is None or status in wanted:
            result += count
    return result


def by(counts: Counts, key: int) -> dict[tuple[str | int, str], Count]:
    """The counts summed per (model or tenant_id, status): ``key`` 0 for the model, 1
    for the tenant."""
    summed: dict[tuple[str | int, str], Count] = defaultdict(Count)
    for k, count in counts.items():
        summed[(k[key], k[2])] += count
    return dict(summed)


def latency_buckets(session: Db) -> dict[tuple[str, str], list[tuple[int, int, int]]]:
    """Per (model, metric): ``(le_ms, n, sum_ms)`` per bucket, not cumulative, by bound."""
    rows: dict[tuple[str, str], list[tuple[int, int, int]]] = defaultdict(list)
    for r in _read(session, query("totals_latency"), {"bounds_ms": LATENCY_BOUNDS_MS}):
        rows[(r.model, r.metric)].append((int(r.le_ms), int(r.n), int(r.sum_ms)))
    return {k: sorted(v) for k, v in rows.items()}


def batches_finished(session: Db, batch_ids: list[str]) -> dict[str, dict[str, int]]:
    """Finished items per status of each of ``batch_ids``."""
    found: dict[str, dict[str, int]] = defaultdict(dict)
    if batch_ids:
        for r in _read(session, query("totals_batches"), {"batch_ids": batch_ids}):
            found[r.batch_id][r.status] = int(r.items)
    return dict(found)


@dataclass(frozen=True)
class StatusFiles:
    """A finished batch's items of one status, and the bytes of their lines in its
    output or error file (None: rolled up before sizes were counted)."""

    items: int
    bytes: int | None


def batch_files(session: Db, batch_id: str) -> dict[str, StatusFiles]:
    """The batch's finished items and their file lines' bytes per status."""
    return {
        r.status: StatusFiles(int(r.items), None if r.bytes is None else int(r.bytes))
        for r in _read(session, query("totals_batch_files"), {"batch_id": batch_id})
    }
