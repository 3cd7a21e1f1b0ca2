"""The store's part of the autoscaling signal: ready items per model
(``sql/runnable_items.sql``); batchgen.monitoring.runnable adds Redis's budget and
slots and batchgen.domain.scheduling.autoscale decides."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from batchgen.store.sqlfiles import query


@dataclass(frozen=True)
class Ready:
    """A model's items that could start now, and their mean estimated tokens."""

    items: int
    tokens_per_item: float


def ready(session: Session, caps: dict[str, int]) -> dict[str, Ready]:
    """Ready items (pending and due, or queued) of each model of ``caps`` that has any,
    counted up to its cap."""
    params = {"models": list(caps), "caps": list(caps.values())}
    rows = session.execute(query("runnable_items"), params)
    return {r.model: Ready(int(r.ready), float(r.tokens_per_item)) for r in rows}
