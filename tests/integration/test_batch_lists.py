"""The tenant's batch lists (``GET /v1/batches``, the dashboard) read their page, not
the synchronous calls stored between its rows: what a page's plan reads stays the same
at ten times the calls (migration 0018's partial indexes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from batchgen.store import activity, batches, db, tenants
from batchgen.store.schema import Tenant
from tests.helpers import make_tenant, statements_sent

LISTED = 3  # the tenant's batches, older than all of its calls
CALLS = 2000  # the calls at the first measure; ten times as many at the second


def _add(tenant_id: int, priority: str, first: int, n: int, age: str) -> None:
    """Finished batches ``first`` to ``first + n - 1`` of the tenant, of ``priority``,
    the newest ``age`` old, each a millisecond older than the one before."""
    with db.session_scope() as session:
        session.execute(
            text(
                """
                INSERT INTO batches (id, tenant_id, status, endpoint, priority,
                                     completion_window_s, deadline_at, total_items,
                                     created_at, finished_at)
                SELECT 'batch_' || :priority || '_' || g, :tenant_id, 'completed',
                       '/v1/chat/completions', :priority, 600, now(), 1,
                       now() - CAST(:age AS interval) - g * interval '1 ms', now()
                FROM generate_series(:first, :first + :n - 1) AS g
                """
            ),
            {"tenant_id": tenant_id, "priority": priority, "first": first, "n": n, "age": age},
        )
    with db.get_engine().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE batches"))


def _add_calls(tenant_id: int, first: int, n: int) -> None:
    """``n`` synchronous calls of the tenant, each a batch of its own, newer than its
    batches: a page of the list passes them all."""
    _add(tenant_id, "call", first, n, "0 s")


def _buffers(read: Callable[[Session], Any]) -> tuple[int, str]:
    """Shared buffers the plan of ``read``'s query touches (hit or read), and the plan."""
    with statements_sent() as sent, db.session_scope() as session:
        read(session)
    seen = [(q, p) for q, p in sent if q.lstrip().startswith("SELECT") and "FROM batches" in q]
    assert len(seen) == 1, seen
    statement, parameters = seen[0]
    with db.get_engine().connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        found = raw.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, parameters
        ).fetchone()
    plan = (found[0] if isinstance(found[0], list) else json.loads(found[0]))[0]["Plan"]
    blocks = plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)
    return blocks, json.dumps(plan)


def _reads(tenant: Tenant) -> dict[str, Callable[[Session], Any]]:
    return {
        "GET /v1/batches": lambda s: batches.list_page(s, tenant, limit=20),
        "dashboard, the tenant's": lambda s: activity.recent_batches(s, tenant.id, 20),
        "dashboard, every tenant's": lambda s: activity.recent_batches(s, None, 20),
    }


def test_a_page_of_batches_reads_the_same_at_ten_times_the_calls(clean_db):
    make_tenant("caller")
    with db.session_scope() as session:
        tenant = tenants.find(session, "caller")
        session.expunge(tenant)
    _add(tenant.id, "bulk", 1, LISTED, "1 day")
    _add_calls(tenant.id, 1, CALLS)
    with db.session_scope() as session:
        assert len(batches.list_page(session, tenant, limit=20)[0]) == LISTED
    few = {label: _buffers(read) for label, read in _reads(tenant).items()}
    _add_calls(tenant.id, CALLS + 1, 9 * CALLS)
    many = {label: _buffers(read) for label, read in _reads(tenant).items()}
    for label, (blocks, plan) in many.items():
        # The same page, the same handful of index and table pages (a level more of
        # the index at most), however many calls lie between its rows.
        assert blocks <= few[label][0] + 2, (label, few[label][0], blocks, plan)
        assert "ix_batches_listed" in plan, (label, plan)
