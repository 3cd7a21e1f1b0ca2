"""Shared test helpers: request lines, waiting for batches, reading the database."""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import func, select

from app import db, tenants


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


def make_tenant(name: str, **kw: Any) -> str:
    """Create a tenant; returns its API key."""
    with db.session_scope() as session:
        _, key = tenants.create_tenant(session, name, **kw)
    return key


def wait_batches(batch_ids: list[str], timeout_s: float = 120.0) -> None:
    """Wait until every batch is finished (completed or cancelled)."""
    from app.schema import Batch

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with db.session_scope() as session:
            open_count = session.scalar(
                select(func.count())
                .select_from(Batch)
                .where(Batch.id.in_(batch_ids), Batch.finished_at.is_(None))
            )
        if open_count == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"batches not finished after {timeout_s}s: {status_summary()}")


def status_summary() -> dict[str, int]:
    from app.schema import Item

    with db.session_scope() as session:
        return dict(session.execute(select(Item.status, func.count()).group_by(Item.status)).all())
