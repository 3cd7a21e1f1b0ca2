"""Bulk-loaded history that follows the schema: tenants, batches, items (pending, some
deferred, and finished), results and ledger rows for the succeeded ones, and the
admitted totals a submit would have added, written with ``INSERT … SELECT`` from
``generate_series`` in one transaction. For bench/scale.py and the plan test at a
million rows (tests/integration/test_totals.py); the finished items are rolled up by
the first :func:`batchgen.store.totals.roll_up`, as after the migration.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

ITEMS_PER_BATCH = 10_000
MODEL = "sim-small"


@dataclass(frozen=True)
class History:
    pending: int  # open items, waiting for the dispatcher
    finished: int  # succeeded items, with a result and a ledger row each
    deferred: bool = False  # every pending item deferred (not_before an hour ahead)
    tenants: int = 20
    # Finished synchronous calls: a batch of one succeeded item each (with its result and
    # ledger row), as many batches as calls.
    calls: int = 0
    # Items per batch; batch n is tenant n's (modulo the tenants): with fewer items per
    # batch, more tenants have some.
    per_batch: int = ITEMS_PER_BATCH
    model: str = MODEL


def load(url: str, history: History) -> None:
    """Add ``history`` to the database at ``url`` (a libpq URL)."""
    total = history.pending + history.finished
    batches = -(-total // history.per_batch)
    finished_batches = history.finished // history.per_batch
    params = {
        "tenants": history.tenants,
        "batches": batches,
        "finished_batches": finished_batches,
        "per_batch": history.per_batch,
        "finished": history.finished,
        "total": total,
        "model": history.model,
        "deferred": history.deferred,
        # Another model's history goes in batches of its own name (loaded beside).
        "prefix": "" if history.model == MODEL else history.model + ".",
    }
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO tenants (name) "
            "SELECT 'history-' || g "
            "FROM generate_series(1, %(tenants)s) AS g ON CONFLICT DO NOTHING",
            params,
        )
        conn.execute(
            """
            INSERT INTO batches (id, tenant_id, status, endpoint, priority,
                                 completion_window_s, deadline_at, total_items,
                                 created_at, finished_at)
            SELECT 'batch_hist_' || %(prefix)s || g,
                   (SELECT id FROM tenants WHERE name = 'history-' || (1 + g %% %(tenants)s)),
                   CASE WHEN g <= %(finished_batches)s THEN 'completed' ELSE 'in_progress' END,
                   '/v1/chat/completions', 'bulk', 172800, now() + interval '1 day',
                   %(per_batch)s, now() - interval '1 day',
                   CASE WHEN g <= %(finished_batches)s THEN now() - interval '20 hours' END
            FROM generate_series(1, %(batches)s) AS g
            """,
            params,
        )
        conn.execute(
            """
            INSERT INTO items (batch_id, tenant_id, line_no, custom_id, model, priority_rank,
                               body, prompt_tokens_est, max_tokens, status, attempts,
                               deadline_at, created_at, not_before, started_at, finished_at)
            SELECT 'batch_hist_' || %(prefix)s || b, t.tenant_id, g %% %(per_batch)s, 'r' || g,
                   %(model)s, 1,
                   '{"messages": [{"role": "user", "content": "Describe it."}]}'::jsonb,
                   10 + g %% 90, 60,
                   CASE WHEN g <= %(finished)s THEN 'succeeded' ELSE 'pending' END,
                   CASE WHEN g <= %(finished)s THEN 1 ELSE 0 END,
                   now() + interval '1 day', now() - interval '1 day',
                   CASE WHEN g > %(finished)s AND %(deferred)s
                        THEN now() + interval '1 hour' END,
                   CASE WHEN g <= %(finished)s THEN now() - interval '21 hours' END,
                   CASE WHEN g <= %(finished)s
                        THEN now() - interval '21 hours' + g * interval '1 millisecond' END
            FROM generate_series(1, %(total)s) AS g
            CROSS JOIN LATERAL (SELECT (g - 1) / %(per_batch)s + 1 AS b) AS bb
            CROSS JOIN LATERAL (
                SELECT tenant_id FROM batches WHERE id = 'batch_hist_' || %(prefix)s || bb.b
            ) AS t
            """,
            params,
        )
        conn.execute(
            """
            INSERT INTO results (item_id, batch_id, tenant_id, attempt, response,
                                 prompt_tokens, completion_tokens, cost_usd,
                                 upstream_latency_ms, queue_wait_ms, created_at)
            SELECT id, batch_id, tenant_id, 1, '{"choices": []}'::jsonb,
                   prompt_tokens_est, 40, 0.0001, 200 + id %% 3000, 1000 + id %% 60000,
                   finished_at
            FROM items
            WHERE status = 'succeeded' AND batch_id LIKE 'batch_hist_' || %(prefix)s || '%%'
            """,
            params,
        )
        conn.execute(
            """
            INSERT INTO usage_ledger (item_id, attempt, tenant_id, batch_id, model,
                                      prompt_tokens, completion_tokens, cost_usd, created_at)
            SELECT item_id, 1, tenant_id, batch_id, %(model)s, prompt_tokens,
                   completion_tokens, cost_usd, created_at
            FROM results WHERE batch_id LIKE 'batch_hist_' || %(prefix)s || '%%'
            """,
            params,
        )
        conn.execute(
            """
            INSERT INTO tenant_daily_usage AS d (tenant_id, day, model, shard, requests,
                                                prompt_tokens, completion_tokens, cost_usd)
            SELECT tenant_id, CAST(timezone('UTC', created_at) AS date), model, item_id %% 16,
                   count(*), sum(prompt_tokens), sum(completion_tokens), sum(cost_usd)
            FROM usage_ledger WHERE batch_id LIKE 'batch_hist_' || %(prefix)s || '%%'
            GROUP BY 1, 2, 3, 4
            ON CONFLICT (tenant_id, day, model, deployment, shard) DO UPDATE
            SET requests = d.requests + EXCLUDED.requests,
                prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
                completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
                cost_usd = d.cost_usd + EXCLUDED.cost_usd
            """,
            params,
        )
        conn.execute(
            """
            INSERT INTO admitted_totals AS a (model, tenant_id, items, tokens_est)
            SELECT model, tenant_id, count(*), sum(prompt_tokens_est + max_tokens)
            FROM items WHERE batch_id LIKE 'batch_hist_' || %(prefix)s || '%%'
            GROUP BY model, tenant_id
            ON CONFLICT (model, tenant_id) DO UPDATE
            SET items = a.items + EXCLUDED.items, tokens_est = a.tokens_est + EXCLUDED.tokens_est
            """,
            params,
        )
        if history.calls:
            _load_calls(conn, {**params, "calls": history.calls})
        conn.commit()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE batches")
        conn.execute("VACUUM ANALYZE items")
        conn.execute("VACUUM ANALYZE results")
        conn.execute("VACUUM ANALYZE usage_ledger")


def _load_calls(conn: psycopg.Connection, params: dict[str, object]) -> None:
    """Finished synchronous calls: one batch, item, result and ledger row each."""
    conn.execute(
        """
        INSERT INTO batches (id, tenant_id, status, endpoint, priority, completion_window_s,
                             deadline_at, total_items, created_at, finished_at)
        SELECT 'batch_call_' || g,
               (SELECT id FROM tenants WHERE name = 'history-' || (1 + g %% %(tenants)s)),
               'completed', '/v1/chat/completions', 'call', 600, now() - interval '1 day',
               1, now() - interval '1 day', now() - interval '20 hours' + g * interval '1 ms'
        FROM generate_series(1, %(calls)s) AS g
        """,
        params,
    )
    conn.execute(
        """
        INSERT INTO items (batch_id, tenant_id, line_no, custom_id, model, priority_rank,
                           body, prompt_tokens_est, max_tokens, status, attempts,
                           deadline_at, created_at, started_at, finished_at)
        SELECT b.id, b.tenant_id, 0, 'call', %(model)s, -1,
               '{"messages": [{"role": "user", "content": "Hi."}]}'::jsonb, 12, 60,
               'succeeded', 1, b.deadline_at, b.created_at, b.created_at, b.finished_at
        FROM batches AS b WHERE b.id LIKE 'batch_call_%%'
        """,
        params,
    )
    conn.execute(
        """
        INSERT INTO results (item_id, batch_id, tenant_id, attempt, response, prompt_tokens,
                             completion_tokens, cost_usd, upstream_latency_ms,
                             queue_wait_ms, created_at)
        SELECT id, batch_id, tenant_id, 1, '{"choices": []}'::jsonb, 12, 40, 0.0001, 300,
               5, finished_at
        FROM items WHERE batch_id LIKE 'batch_call_%%'
        """,
        params,
    )
    conn.execute(
        """
        INSERT INTO usage_ledger (item_id, attempt, tenant_id, batch_id, model,
                                  prompt_tokens, completion_tokens, cost_usd, created_at)
        SELECT item_id, 1, tenant_id, batch_id, %(model)s, 12, 40, 0.0001, created_at
        FROM results WHERE batch_id LIKE 'batch_call_%%'
        """,
        params,
    )


# The scans whose cost must not grow with the history, with the parameters of a round.
PLANNED = {
    "dispatch: ring of tenants": (
        "dispatch_ring",
        {"model": MODEL, "lo": 0, "hi": 2**63 - 1, "limit": 16},
    ),
    "dispatch: release picks": (
        "item_release",
        {
            "model": MODEL,
            "tenant_ids": [1, 2],
            "takes": [8, 8],
            "lease_s": 60,
            "sources": ["pending"],
            "target": "queued",
        },
    ),
    "deferred items due": ("item_ready_due", {"model": MODEL, "limit": 1000}),
    "dispatch: models with work": ("models_with_work", {"models": [MODEL, f"{MODEL}-idle"]}),
    "sweep: expired deadlines": ("sweep_expire", {}),
    "sweep: lost leases": (
        "sweep_requeue_lost",
        {"max_attempts": 3, "attempt_caps": "{}", "alive": [], "callers_gone": []},
    ),
    "sweep: batches left open": ("unfinished_batches", {}),
    "retention: expired batches": (
        "retention_expired_batches",
        {"retention_s": 3600, "limit": 100},
    ),
    "retention: a batch's items": (
        "retention_purge_items",
        {"batch_id": "batch_hist_1", "limit": 5000},
    ),
    "retention: the batch row": ("retention_purge_batch", {"batch_id": "batch_hist_1"}),
    "totals: finished": ("totals_finished", {"since": "now"}),
    "totals: open": (
        "totals_open",
        {"since": "now", "models": [MODEL], "model": MODEL, "tenant_id": None},
    ),
}


def plans(url: str) -> dict[str, str]:
    """``EXPLAIN`` (not run) of each scan in :data:`PLANNED`, by name."""
    from sqlalchemy import text

    from batchgen.store.db import get_engine
    from batchgen.store.sqlfiles import source

    found = {}
    with get_engine(url).connect() as conn:
        for label, (name, params) in PLANNED.items():
            rows = conn.execute(text("EXPLAIN " + source(name)), params).all()
            found[label] = "\n".join(r[0] for r in rows)
        conn.rollback()
    return found


# The tables that grow with the history.
LARGE_TABLES = ("items", "results", "usage_ledger", "batches")


def seq_scans_of_items(plan: str, tables: tuple[str, ...] = ("items",)) -> list[str]:
    """The plan's lines that read one of ``tables`` (default: the items) whole."""
    return [
        line.strip()
        for line in plan.splitlines()
        if any(f"Seq Scan on {table} " in line + " " for table in tables)
    ]
