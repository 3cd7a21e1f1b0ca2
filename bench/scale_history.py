"""bench/scale.py's history part: ``/metrics``, the status view, a 1k-line submit, an idle
dispatch round and the sweep's expiry at ``--pending`` pending (all deferred) and
``--finished`` finished items, each next to the formula of the last release (migration
0008), and the plans of the scans that must not grow with the history."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from bench import history

# The 0008 formulas, as they ran on every scrape, status view, submit and round.
BEFORE_METRICS = [
    "SELECT model, status, count(*) FROM items GROUP BY model, status",
    "SELECT t.name, i.status, count(*) FROM tenants t JOIN items i ON i.tenant_id = t.id "
    "GROUP BY t.name, i.status",
    *[
        "SELECT i.model, "
        + ", ".join(
            f"count(*) FILTER (WHERE r.{col} <= {int(b * 1000)})"
            for b in (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        )
        + f", count(*), coalesce(sum(r.{col}), 0) FROM results r JOIN items i ON i.id = r.item_id "
        "GROUP BY i.model"
        for col in ("queue_wait_ms", "upstream_latency_ms")
    ],
    "SELECT t.name, sum(d.prompt_tokens), sum(d.completion_tokens), sum(d.cost_usd) "
    "FROM tenants t JOIN tenant_daily_usage d ON d.tenant_id = t.id GROUP BY t.name",
    "SELECT sum(requests), sum(prompt_tokens), sum(completion_tokens), sum(offline_requests), "
    "sum(offline_prompt_tokens), sum(offline_completion_tokens), sum(saved_usd) "
    "FROM tenant_daily_usage",
]
OPEN = "('pending', 'queued', 'running', 'offloaded')"
BEFORE_STATUS = [
    f"SELECT model, status, count(*) FROM items WHERE status IN {OPEN} GROUP BY model, status",
    f"SELECT model, sum(prompt_tokens_est + max_tokens) FROM items WHERE status IN {OPEN} "
    "GROUP BY model",
    "SELECT model, count(*) FROM items WHERE finished_at >= now() - interval '5 minutes' "
    "GROUP BY model",
    "SELECT t.name, b.id, b.status, b.total_items, count(*) FILTER (WHERE i.status IN "
    "('succeeded', 'failed', 'expired', 'cancelled')) FROM tenants t "
    "JOIN batches b ON b.tenant_id = t.id JOIN items i ON i.batch_id = b.id "
    "WHERE b.finished_at IS NULL GROUP BY t.name, b.id, b.status, b.total_items",
]
BEFORE_ADMISSION = [
    "SELECT coalesce(sum(prompt_tokens_est + max_tokens), 0) FROM items "
    f"WHERE status IN ('pending', 'queued', 'running') AND model = '{history.MODEL}'",
    f"SELECT count(*) FROM items WHERE tenant_id = :tenant AND status IN {OPEN}",
]
# The 0008 release: its candidate query (dispatch_candidates.sql then), over its index.
BEFORE_INDEX = [
    "DROP INDEX ix_items_pending_by_model",
    "CREATE INDEX ix_items_pending_0008 ON items (model, tenant_id, priority_rank, id) "
    "WHERE status = 'pending'",
]
BEFORE_CANDIDATES = """
WITH inflight AS (
    SELECT tenant_id, count(*) AS n FROM items
    WHERE model = :model AND status IN ('queued', 'running') GROUP BY tenant_id
)
SELECT c.id, t.id AS tenant_id FROM tenants AS t
LEFT JOIN inflight AS f ON f.tenant_id = t.id
CROSS JOIN LATERAL (
    SELECT i.id, row_number() OVER (ORDER BY i.priority_rank, i.id) AS position
    FROM items AS i
    WHERE i.tenant_id = t.id AND i.model = :model AND i.status = 'pending'
      AND (i.not_before IS NULL OR i.not_before <= now())
      AND NOT EXISTS (SELECT 1 FROM batches AS b
                      WHERE b.id = i.batch_id AND b.cancel_requested_at IS NOT NULL)
    ORDER BY i.priority_rank, i.id LIMIT :limit
) AS c
ORDER BY (coalesce(f.n, 0) + c.position - random()) / t.weight, c.id
LIMIT :limit
"""


def _median_ms(run: Callable[[], Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def _queries(statements: list[str], **params: Any) -> Callable[[], None]:
    from batchgen.store.db import get_engine

    def run() -> None:
        with get_engine().connect() as conn:
            for sql in statements:
                conn.execute(text(sql), params).all()
            conn.rollback()

    return run


def _in_rolled_back(setup: list[str], sql: str, repeat: int, **params: Any) -> float:
    """The median time of ``sql`` in a transaction that first runs ``setup`` (index
    changes) and is rolled back, so the schema is left as it was."""
    from batchgen.store.db import get_engine

    with get_engine().connect() as conn:
        for statement in setup:
            conn.execute(text(statement))
        conn.execute(text("ANALYZE items"))
        ms = _median_ms(lambda: conn.execute(text(sql), params).all(), repeat)
        conn.rollback()
    return ms


@dataclass
class History:
    rows: list[tuple[str, float, float]]  # label, now ms, 0008 ms
    load_s: float
    first_roll_up_s: float
    plans: dict[str, str]


def run(url: str, pending: int, finished: int, calls: int, repeat: int) -> History:
    """Load the history (``url``: the SQLAlchemy URL) and time each view against 0008."""
    from batchgen import python_api
    from batchgen.config import get_settings
    from batchgen.limits.backend import get_redis
    from batchgen.monitoring.metrics import StateCollector, render
    from batchgen.monitoring.snapshot import snapshot
    from batchgen.registry import get_registry
    from batchgen.store import db, rounds, tenants, totals
    from bench.harness import chat_requests

    rows: list[tuple[str, float, float]] = []
    started = time.perf_counter()
    history.load(
        url.replace("postgresql+psycopg://", "postgresql://"),
        history.History(pending=pending, finished=finished, deferred=True, calls=calls),
    )
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    with db.session_scope() as session:
        totals.roll_up(session)
    first_roll_up_s = time.perf_counter() - started
    with db.session_scope() as session:
        tenant, _ = tenants.create_tenant(session, "bench-submit")
        tenant_id = tenant.id
    registry, client, settings = get_registry(), get_redis(), get_settings()

    def scrape() -> None:
        render(StateCollector(db.session_scope, client, registry, settings))

    def status() -> None:
        with db.session_scope() as session:
            snapshot(session, client, registry, settings)

    lines = [json.dumps(r).encode() for r in chat_requests(1000, history.MODEL, "scale")]

    def submit() -> None:
        python_api.submit_batch(lines, tenant="bench-submit", priority="bulk")

    def dispatch_round() -> None:
        with db.session_scope() as session:
            assert rounds.release(session, history.MODEL, 16, 60) == []

    scrape(), status(), dispatch_round()  # warm: connections, compiled statements
    rows.append(
        ("/metrics", _median_ms(scrape, repeat), _median_ms(_queries(BEFORE_METRICS), repeat))
    )
    rows.append(("status", _median_ms(status, repeat), _median_ms(_queries(BEFORE_STATUS), repeat)))
    before_admission = _median_ms(_queries(BEFORE_ADMISSION, tenant=tenant_id), repeat)
    rows.append(
        (
            "idle round",
            _median_ms(dispatch_round, repeat),
            _in_rolled_back(
                BEFORE_INDEX,
                BEFORE_CANDIDATES,
                repeat,
                model=history.MODEL,
                limit=16,
            ),
        )
    )
    expiry = "SELECT id FROM items WHERE status IN ('pending', 'queued') AND deadline_at <= now()"
    rows.append(
        (
            "sweep expiry",
            _in_rolled_back([], expiry, repeat),
            _in_rolled_back(["DROP INDEX ix_items_unstarted_deadline"], expiry, repeat),
        )
    )
    submit()  # warm
    rows.append(("submit 1k", _median_ms(submit, repeat), before_admission))
    return History(rows, load_s, first_roll_up_s, history.plans(url))
