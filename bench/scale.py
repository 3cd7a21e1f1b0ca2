"""What the history costs: ``/metrics``, a 1k-line submit, a dispatch round and the
sweep's expiry at a million pending and a million finished items, each next to the
formula of the last release (migration 0008: counts over every item row, the open
backlog summed item by item, deferred items filtered one by one), in one run; then
large submissions against a raw COPY of the same rows.

Set-up: PostgreSQL and Redis (embedded, or the given ``DATABASE_URL`` / ``REDIS_URL``
in a database of their own); ``--pending`` pending items (all deferred an hour, so a
dispatch round finds none ready) and ``--finished`` succeeded ones with their results
and ledger rows, bulk-loaded by bench/history.py as the schema has them; then one
roll-up of the finished history (once, as after the migration).

Each figure is the median of ``--repeat`` runs, in milliseconds:

  /metrics        one scrape (the collector of ``GET /metrics``, in process)
                  before: the same families by the 0008 queries
  status          the ``/v1/status`` snapshot; before: its 0008 queries
  submit 1k       ``python_api.submit_batch`` of 1,000 lines (admission included)
                  before: the 0008 admission queries alone (the backlog's sum and the
                  tenant's open count), which a submit ran on top of the rest
  dispatch round  ``store.items.release`` for the model (all pending deferred)
                  before: the 0008 candidate query with its index, in a transaction
                  that puts that index back and is rolled back
  sweep expiry    the expiry UPDATE (nothing due); before: the same without its index
                  (dropped in a transaction rolled back)

Then the plans of the dispatcher's, the sweep's and the totals' scans (EXPLAIN, as
tests/integration/test_totals.py checks them) at this size, and bench/submission.py's
comparison at ``--submit-lines`` (HTTP and the Python API against COPY, with the API
process's peak RSS).

    .venv/bin/python bench/scale.py [--pending 1000000] [--finished 1000000] [--repeat 5]
                                    [--submit-lines 200000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import text

from bench import history
from bench.harness import servers

TARGETS_MS = {"/metrics": 100.0, "submit 1k": 100.0, "dispatch round": 20.0}

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
BEFORE_CANDIDATES = """
WITH inflight AS (
    SELECT tenant_id, count(*) AS n FROM items
    WHERE model = :model AND status IN ('queued', 'running') GROUP BY tenant_id
)
SELECT c.id FROM tenants AS t
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


def _submit_comparison(lines: int) -> str:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("submission.py")), "--lines", str(lines)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--submit-lines", type=int, default=200_000)
    args = parser.parse_args()

    from batchgen import python_api
    from batchgen.config import get_settings
    from batchgen.limits.backend import get_redis
    from batchgen.monitoring.metrics import StateCollector, render
    from batchgen.monitoring.snapshot import snapshot
    from batchgen.registry import get_registry
    from batchgen.store import db, items, tenants, totals
    from bench.harness import chat_requests

    rows: list[tuple[str, float, float | None]] = []
    with servers():
        url = get_settings().sqlalchemy_url
        started = time.perf_counter()
        history.load(
            url.replace("postgresql+psycopg://", "postgresql://"),
            history.History(pending=args.pending, finished=args.finished, deferred=True),
        )
        load_s = time.perf_counter() - started
        started = time.perf_counter()
        with db.session_scope() as session:
            totals.roll_up(session)
        first_roll_up_s = time.perf_counter() - started
        with db.session_scope() as session:
            _, _ = tenants.create_tenant(session, "bench-submit")
            tenant_id = session.execute(
                text("SELECT id FROM tenants WHERE name = 'bench-submit'")
            ).scalar_one()
        registry, client, settings = get_registry(), get_redis(), get_settings()

        def scrape() -> None:
            render(StateCollector(db.session_scope, client, registry, settings))

        def status() -> None:
            with db.session_scope() as session:
                snapshot(session, client, registry, settings)

        lines = [json.dumps(r).encode() for r in chat_requests(1000, history.MODEL, "scale")]
        submitted = 0

        def submit() -> None:
            nonlocal submitted
            submitted += 1
            python_api.submit_batch(lines, tenant="bench-submit", priority="bulk")

        def dispatch_round() -> None:
            with db.session_scope() as session:
                assert items.release(session, history.MODEL, 16, 60) == []

        scrape(), status(), dispatch_round()  # warm: connections, compiled statements
        rows.append(
            (
                "/metrics",
                _median_ms(scrape, args.repeat),
                _median_ms(_queries(BEFORE_METRICS), args.repeat),
            )
        )
        rows.append(
            (
                "status",
                _median_ms(status, args.repeat),
                _median_ms(_queries(BEFORE_STATUS), args.repeat),
            )
        )
        before_admission = _median_ms(_queries(BEFORE_ADMISSION, tenant=tenant_id), args.repeat)
        rows.append(
            (
                "dispatch round",
                _median_ms(dispatch_round, args.repeat),
                _in_rolled_back(
                    [
                        "DROP INDEX ix_items_pending_by_model",
                        "CREATE INDEX ix_items_pending_0008 ON items "
                        "(model, tenant_id, priority_rank, id) WHERE status = 'pending'",
                    ],
                    BEFORE_CANDIDATES,
                    args.repeat,
                    model=history.MODEL,
                    limit=16,
                ),
            )
        )
        expiry = (
            "SELECT id FROM items WHERE status IN ('pending', 'queued') AND deadline_at <= now()"
        )
        rows.append(
            (
                "sweep expiry",
                _in_rolled_back([], expiry, args.repeat),
                _in_rolled_back(["DROP INDEX ix_items_unstarted_deadline"], expiry, args.repeat),
            )
        )
        submit()  # warm
        rows.append(("submit 1k", _median_ms(submit, args.repeat), before_admission))
        plans = history.plans(url)

    print(
        f"history: {args.pending:,} pending (all deferred) + {args.finished:,} finished items "
        f"with results and ledger rows; loaded in {load_s:.0f} s, first roll-up "
        f"{first_roll_up_s:.1f} s (once)"
    )
    print(f"{'':16}{'now ms':>10}{'target':>10}{'0008 ms':>12}{'0008/now':>10}")
    for label, now_ms, before_ms in rows:
        target = TARGETS_MS.get(label)
        mark = "" if target is None else ("ok" if now_ms <= target else "OVER")
        print(
            f"{label:16}{now_ms:>10.1f}{(f'{target:.0f} {mark}' if target else ''):>10}"
            f"{before_ms:>12.1f}{before_ms / now_ms:>10.1f}"
        )
    print("  (submit 1k's 0008 column: its admission queries alone, on top of the rest)")
    print("plans at this size (whole-table reads of items):")
    for label, plan in plans.items():
        whole = history.seq_scans_of_items(plan)
        print(f"  {label:26} {whole or 'none'}")
    if args.submit_lines:
        print(f"submission of {args.submit_lines:,} lines (bench/submission.py):")
        print(_submit_comparison(args.submit_lines), end="")


if __name__ == "__main__":
    main()
