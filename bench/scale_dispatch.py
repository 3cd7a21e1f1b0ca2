"""bench/scale.py's dispatch part: a round at ``--pending`` ready items spread over 50,
500 and 5 000 tenants (with idle tenants besides), and the fairness of 100 rounds at
500 tenants of weights 1 to 3, each next to the 0008 candidate query (its index put
back in a transaction rolled back)."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from bench import history
from bench.scale_history import BEFORE_CANDIDATES, BEFORE_INDEX

WINDOW = 32  # sim-small's window: 16 slots x the default ahead factor of 2
LEASE_S = 60.0
TABLES = (
    "tenant_daily_usage, usage_ledger, results, provider_job_items, items, "
    "batch_notifications, provider_jobs, batches, admitted_totals, finished_totals, "
    "batch_totals, latency_totals, dispatch_ring, dispatch_clocks"
)


@dataclass
class Rounds:
    tenants: int
    round_ms: float  # median
    old_round_ms: float
    jain: float | None = None
    served: int | None = None
    old_jain: float | None = None
    old_served: int | None = None


def reset() -> None:
    """Every batch, item and total gone (tenants stay)."""
    from batchgen.store.db import get_engine

    with get_engine().begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES}"))
        conn.execute(text("UPDATE totals_watermark SET rolled_up_before = NULL"))


def make_tenants(busy: int, idle: int, weights: int) -> None:
    """``busy`` history tenants (weights 1 to ``weights`` in turn), then ``idle`` more."""
    from batchgen.store.db import get_engine

    with get_engine().begin() as conn:
        for prefix, n in (("history-", busy), ("idle-", idle)):
            conn.execute(
                text(
                    "INSERT INTO tenants (name, weight) "
                    "SELECT :prefix || g, 1 + (g - 1) % :w "
                    "FROM generate_series(1, :n) AS g ON CONFLICT DO NOTHING"
                ),
                {"prefix": prefix, "n": n, "w": weights},
            )


def model_of(tenants: int) -> str:
    """The model whose pending items are spread over ``tenants`` tenants."""
    return f"bench-{tenants}"


def _finish(conn: Any, ids: list[int]) -> None:
    conn.execute(
        text("UPDATE items SET status = 'succeeded', finished_at = now() WHERE id = ANY(:ids)"),
        {"ids": ids},
    )


def new_round(model: str) -> tuple[float, list[int]]:
    """One round of ``store.rounds.release`` (its own transaction), its releases then
    finished as workers would; the round's ms and the tenant of each release."""
    from batchgen.store import db, rounds

    started = time.perf_counter()
    with db.session_scope() as session:
        tickets = rounds.release(session, model, WINDOW, LEASE_S)
    ms = (time.perf_counter() - started) * 1000
    with db.get_engine().begin() as conn:
        _finish(conn, [t.item_id for t in tickets])
    return ms, [t.tenant_id for t in tickets]


def old_round(conn: Any, model: str) -> tuple[float, list[int]]:
    """One round of the 0008 release (its candidate query, then the update) in the
    caller's transaction, its releases then finished."""
    started = time.perf_counter()
    rows = conn.execute(text(BEFORE_CANDIDATES), {"model": model, "limit": WINDOW}).all()
    conn.execute(
        text("UPDATE items SET status = 'queued' WHERE id = ANY(:ids)"),
        {"ids": [r.id for r in rows]},
    )
    ms = (time.perf_counter() - started) * 1000
    _finish(conn, [r.id for r in rows])
    return ms, [r.tenant_id for r in rows]


def jain_of(served: Counter[int], weights: dict[int, int]) -> float:
    from batchgen.domain.scheduling.round_robin import jain_index

    return jain_index(served.get(t, 0) / w for t, w in weights.items())


def _weights(model: str) -> dict[int, int]:
    """The weight of each tenant with pending items on ``model``."""
    from batchgen.store.db import get_engine

    with get_engine().connect() as conn:
        rows = conn.execute(
            text(
                "SELECT t.id, t.weight FROM tenants AS t WHERE EXISTS (SELECT 1 FROM items AS i "
                "WHERE i.tenant_id = t.id AND i.model = :m AND i.status = 'pending')"
            ),
            {"m": model},
        ).all()
    return {r.id: r.weight for r in rows}


def run(
    url: str, pending: int, sizes: list[int], idle: int, rounds_n: int, fair_at: int, repeat: int
) -> tuple[list[Rounds], float]:
    """``pending`` items on a model of their own for each size of ``sizes`` (the tenants
    they are spread over, in two batches each), ``idle`` tenants besides; rounds of the
    sizes taken in turn (so that the machine's load falls on each alike), ``repeat``
    each, and ``rounds_n`` rounds' fairness at ``fair_at`` tenants; then the same with
    the 0008 release. Returns the rows and the seconds the loads took."""
    from batchgen.store.db import get_engine

    reset()
    make_tenants(max(sizes), idle, weights=3)
    started = time.perf_counter()
    for tenants in sizes:
        per_batch = max(1, pending // (2 * tenants))
        history.load(
            url,
            history.History(
                pending=pending,
                finished=0,
                tenants=tenants,
                per_batch=per_batch,
                model=model_of(tenants),
            ),
        )
    load_s = time.perf_counter() - started
    weights = _weights(model_of(fair_at))

    new_ms: dict[int, list[float]] = {n: [] for n in sizes}
    for n in sizes:
        new_round(model_of(n))  # warm: connections, statements, the ring's first position
    for _ in range(repeat):
        for n in sizes:
            new_ms[n].append(new_round(model_of(n))[0])
    served: Counter[int] = Counter()
    for _ in range(rounds_n):
        served.update(new_round(model_of(fair_at))[1])

    old_ms: dict[int, list[float]] = {n: [] for n in sizes}
    old_served: Counter[int] = Counter()
    with get_engine().connect() as conn:
        for statement in BEFORE_INDEX:
            conn.execute(text(statement))
        conn.execute(text("ANALYZE items"))
        for _ in range(repeat):
            for n in sizes:
                old_ms[n].append(old_round(conn, model_of(n))[0])
        for _ in range(rounds_n):
            old_served.update(old_round(conn, model_of(fair_at))[1])
        conn.rollback()

    found = []
    for n in sizes:
        row = Rounds(n, statistics.median(new_ms[n]), statistics.median(old_ms[n]))
        if n == fair_at:
            row.jain, row.served = jain_of(served, weights), len(served)
            row.old_jain, row.old_served = jain_of(old_served, weights), len(old_served)
        found.append(row)
    reset()
    return found, load_s
