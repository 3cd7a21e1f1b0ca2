"""Shared test helpers: request lines, waiting for batches, reading the database."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text

from batchgen.store import db, tenants
from tests import http_client
from tests.waiting import wait_until

# Kept, not emptied: the totals' watermark row (reset by clean_db).
KEPT_TABLES = {"totals_watermark"}


def emptied_tables() -> list[str]:
    """The schema's tables a test empties, children before their parents."""
    from batchgen.store.schema import Base

    return [t.name for t in reversed(Base.metadata.sorted_tables) if t.name not in KEPT_TABLES]


def truncate_tables(conn: Any) -> None:
    """Empty the schema's tables into new files: no page or index entry of an earlier
    test left behind, as in a fresh database."""
    conn.execute(text(f"TRUNCATE {', '.join(emptied_tables())} RESTART IDENTITY"))


def chat_line(
    custom_id: str,
    model: str = "sim-small",
    text: str | None = None,
    max_tokens: int = 60,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text or f"Describe product {custom_id}."}],
    }
    body.update(extra)
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def message_request(custom_id: str, text: str = "hi", **params: Any) -> dict[str, Any]:
    """One request of an Anthropic Message Batch (``{custom_id, params}``)."""
    return {
        "custom_id": custom_id,
        "params": {
            "model": "sim-claude",
            "max_tokens": 20,
            "messages": [{"role": "user", "content": text}],
            **params,
        },
    }


def make_tenant(name: str, **kw: Any) -> str:
    """Create a tenant; returns its API key."""
    with db.session_scope() as session:
        _, key = tenants.create_tenant(session, name, **kw)
    return key


def wait_batches(batch_ids: list[str], timeout_s: float = 120.0) -> None:
    """Wait until every batch is finished (completed or cancelled)."""
    from batchgen.store.schema import Batch

    def all_finished() -> bool:
        try:
            with db.session_scope() as session:
                open_count = session.scalar(
                    select(func.count())
                    .select_from(Batch)
                    .where(Batch.id.in_(batch_ids), Batch.finished_at.is_(None))
                )
        except Exception as exc:  # this process's pooled connection was cut by a fault
            if not db.is_transient(exc):
                raise
            return False
        return open_count == 0

    wait_until(all_finished, timeout_s, lambda: f"the batches to finish: {status_summary()}", 0.2)


def status_summary() -> dict[str, int]:
    from batchgen.store.schema import Item

    with db.session_scope() as session:
        return dict(session.execute(select(Item.status, func.count()).group_by(Item.status)).all())


TOKEN_KINDS = ("cached_tokens", "cache_write_tokens", "reasoning_tokens")


def usage_totals(table: Any, *where: Any) -> tuple:
    """(rows, prompt tokens, completion tokens, cost, cached, cache write and reasoning
    tokens) of ``results`` or ``usage_ledger``."""
    with db.session_scope() as session:
        return tuple(
            session.execute(
                select(
                    func.count(),
                    func.coalesce(func.sum(table.prompt_tokens), 0),
                    func.coalesce(func.sum(table.completion_tokens), 0),
                    func.coalesce(func.sum(table.cost_usd), 0),
                    *(func.coalesce(func.sum(getattr(table, k)), 0) for k in TOKEN_KINDS),
                ).where(*where)
            ).one()
        )


def assert_ledger_is_results_plus_waste() -> None:
    """Exactly-once accounting: every billed call is in the ledger, each result once,
    and what is not a result is marked as waste."""
    from batchgen.store.schema import Result, UsageLedger

    ledger = usage_totals(UsageLedger)
    results = usage_totals(Result)
    waste = usage_totals(UsageLedger, UsageLedger.waste_reason.is_not(None))
    assert [r + w for r, w in zip(results, waste, strict=True)] == list(ledger)


def assert_daily_usage_matches_ledger() -> None:
    """``tenant_daily_usage`` holds the ledger's totals per tenant and model: one request
    per ledger row, the same tokens and cost."""
    from batchgen.store.schema import TenantDailyUsage, UsageLedger

    def totals(table: Any, count: Any) -> dict[tuple, tuple]:
        with db.session_scope() as session:
            rows = session.execute(
                select(
                    table.tenant_id,
                    table.model,
                    count,
                    func.sum(table.prompt_tokens),
                    func.sum(table.completion_tokens),
                    func.sum(table.cost_usd),
                    *(func.sum(getattr(table, k)) for k in TOKEN_KINDS),
                ).group_by(table.tenant_id, table.model)
            ).all()
        return {(r[0], r[1]): tuple(r[2:]) for r in rows}

    ledger = totals(UsageLedger, func.count())
    daily = totals(TenantDailyUsage, func.sum(TenantDailyUsage.requests))
    assert daily == ledger


def usage_by_deployment_from_ledger(
    tenant_id: int | None = None, session: Any = None
) -> list[dict[str, Any]]:
    """``GET /v1/usage?group_by=deployment`` as the ledger's own rows give it, all of
    them (what the report read before the deployments had totals): the reference for
    those totals. ``session``: on another database than the app's."""
    from batchgen.store.schema import UsageLedger as u
    from batchgen.store.usage import deployment_row

    wasted, offline = u.waste_reason.is_not(None), u.route == "offline"
    query = (
        select(
            u.model,
            u.deployment,
            func.count(),
            *(func.sum(getattr(u, k)) for k in ("prompt_tokens", "completion_tokens")),
            *(func.sum(getattr(u, k)) for k in TOKEN_KINDS),
            func.sum(u.cost_usd),
            func.count().filter(wasted),
            func.coalesce(func.sum(u.cost_usd).filter(wasted), 0),
            func.count().filter(offline),
            func.coalesce(func.sum(u.cost_usd).filter(offline), 0),
            func.coalesce(func.sum(u.prompt_tokens).filter(offline), 0),
            func.coalesce(func.sum(u.completion_tokens).filter(offline), 0),
            func.coalesce(func.sum(u.online_cost_usd - u.cost_usd).filter(offline), 0),
        )
        .group_by(u.model, u.deployment)
        .order_by(u.model, u.deployment)
    )
    if tenant_id is not None:
        query = query.where(u.tenant_id == tenant_id)
    if session is not None:
        return [deployment_row(r) for r in session.execute(query)]
    with db.session_scope() as own:
        return [deployment_row(r) for r in own.execute(query)]


@contextmanager
def statements_sent() -> Iterator[list[tuple[str, Any]]]:
    """Every statement the process's engine sends inside the block, with its
    parameters (SQLAlchemy's ``before_cursor_execute``)."""
    from sqlalchemy import event

    seen: list[tuple[str, Any]] = []

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        seen.append((statement, parameters))

    engine = db.get_engine()
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


# --- Fault tests (tests/integration/test_faults_*.py) -----------------------------

# Worker settings for fault tests: short leases and a fast sweep, so the items of a
# killed worker come back within seconds.
FAULT_CALL_TIMEOUT_S = 3
FAULT_LEASE_MARGIN_S = 1
# batchgen.limits.gate.running_lease_s with these settings: how long a dead worker's item and
# concurrency slot stay taken.
FAULT_RUNNING_LEASE_S = 2 * FAULT_CALL_TIMEOUT_S + FAULT_LEASE_MARGIN_S
FAULT_ENV = {
    "BATCHGEN_CALL_TIMEOUT_S": str(FAULT_CALL_TIMEOUT_S),
    "BATCHGEN_RUNNING_LEASE_MARGIN_S": str(FAULT_LEASE_MARGIN_S),
    "BATCHGEN_QUEUED_LEASE_S": "6",
    "BATCHGEN_SWEEP_INTERVAL_S": "0.5",
    # A Redis that lost the gate's state restarts its budgets as spent for one window
    # (app/worker/gate_recovery.py): a short window keeps that wait short.
    "BATCHGEN_BUDGET_WINDOW_S": "5",
}


def sim_config(base_url: str, **changes: Any) -> None:
    """Change the simulator's run-time settings (``POST /_sim/config``)."""
    http_client.post(f"{base_url}/_sim/config", json=changes, timeout=10).raise_for_status()


def sim_in_flight(base_url: str) -> int:
    """Calls the simulator is answering right now."""
    return int(http_client.get(f"{base_url}/_sim/stats", timeout=10).json()["in_flight"])


def submit_items(tenant: str, n: int) -> str:
    """A new tenant and one batch of ``n`` chat requests for it; returns the batch id."""
    from batchgen import python_api as client

    make_tenant(tenant)
    batch = client.submit_batch([chat_line(f"{tenant}-{i}") for i in range(n)], tenant=tenant)
    return str(batch["id"])


def succeeded_items(batch_id: str) -> int:
    from batchgen.store.schema import Item

    with db.session_scope() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(Item)
                .where(Item.batch_id == batch_id, Item.status == "succeeded")
            )
            or 0
        )


def wait_mid_run(simulator_url: str, batch_id: str, at_least: int = 10) -> None:
    """Wait until a run is under way: ``at_least`` items done and calls in flight now."""
    wait_until(
        lambda: succeeded_items(batch_id) >= at_least and sim_in_flight(simulator_url) > 0,
        60,
        lambda: f"the run to get under way: {status_summary()}",
        0.05,
    )


def models_file_with(path: Path, model: str = "sim-small", **fields: Any) -> Path:
    """The shipped registry written to ``path`` with ``fields`` of ``model`` set (a
    field the model has is replaced in place, any other is added to its section)."""
    from batchgen.config import DEFAULT_MODELS_FILE

    source = DEFAULT_MODELS_FILE.read_text(encoding="utf-8")
    header = f'[models."{model}"]\n'
    head, found, rest = source.partition(header)
    assert found, f"no model {model} in the shipped registry"
    end = rest.find("\n[")
    section, tail = (rest, "") if end < 0 else (rest[: end + 1], rest[end + 1 :])
    for key, value in fields.items():
        line = f"{key} = {json.dumps(value)}"
        section, replaced = re.subn(rf"(?m)^{re.escape(key)} = .*$", line, section, count=1)
        if not replaced:
            section = line + "\n" + section
    path.write_text(head + header + section + tail, encoding="utf-8")
    return path


def dashboard_sign_in(web: Any, key: str, prefix: str = "", **kwargs: Any) -> Any:
    """Sign a Flask test client in to the dashboard as a browser does: fetch the sign-in
    form (its token and cookie), then post the key with the token; returns the answer."""
    page = web.get(f"{prefix}/dashboard", **kwargs)
    assert page.status_code == 200
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found, "the sign-in form carries no token"
    return web.post(
        f"{prefix}/dashboard/login", data={"key": key, "csrf": found.group(1)}, **kwargs
    )


# The states an OpenAI batch ends in.
OPENAI_BATCH_ENDED = frozenset({"completed", "failed", "expired", "cancelled"})


def openai_batch_in(
    client: Any,
    batch_id: str,
    until: frozenset[str] | set[str] = OPENAI_BATCH_ENDED,
    timeout_s: float = 90.0,
) -> Any:
    """The OpenAI SDK's batch ``batch_id`` once its status is one of ``until``."""
    seen: list[str] = []

    def reached() -> Any:
        batch = client.batches.retrieve(batch_id)
        seen[:] = [batch.status]
        return batch if batch.status in until else None

    return wait_until(
        reached, timeout_s, lambda: f"batch {batch_id} in {sorted(until)}: {seen}", 0.2
    )


def anthropic_batch_ended(client: Any, batch_id: str, timeout_s: float = 90.0) -> Any:
    """The Anthropic SDK's message batch ``batch_id`` once it has ended."""

    def ended() -> Any:
        batch = client.messages.batches.retrieve(batch_id)
        return batch if batch.processing_status == "ended" else None

    return wait_until(ended, timeout_s, f"message batch {batch_id} to end", 0.2)


def settled_entry(base_url: str, item: object, timeout_s: float = 5.0) -> dict[str, Any]:
    """The simulator's log entry of ``item`` once the server is done with it."""
    entries: list[dict[str, Any]] = []

    def settled() -> dict[str, Any] | None:
        got = http_client.get(f"{base_url}/_sim/log", params={"item": str(item)}, timeout=10).json()
        entries[:] = got
        return got[0] if got and got[0]["end_ts"] is not None else None

    return wait_until(
        settled, timeout_s, lambda: f"a finished log entry of {item}: {entries}", 0.02
    )
