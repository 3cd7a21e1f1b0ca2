"""The store's part of the autoscaling signal: ready items per model
(``sql/runnable_items.sql``); batchgen.monitoring.runnable adds Redis's budget and
slots and batchgen.domain.autoscale decides."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from batchgen.store.sqlfiles import query


@dataclass(frozen=True)
class Ready:
    """A model's items that could start now, and their mean estimated tokens."""

    items: int
    tokens_per_item: float


def ready(session: Session, models: list[str]) -> dict[str, Ready]:
    """Ready items (pending and due, or queued) of each of ``models`` that has any."""
    rows = session.execute(query("runnable_items"), {"models": models})
    return {r.model: Ready(int(r.ready), float(r.tokens_per_item)) for r in rows}
