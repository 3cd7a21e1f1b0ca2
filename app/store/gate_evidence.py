"""The database's evidence of recent use of the gate (``sql/gate_evidence.sql``), for
rebuilding what Redis lost (:mod:`batchgen.domain.scheduling.gate_rebuild`)."""

from __future__ import annotations

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from batchgen.domain.scheduling.gate_rebuild import Evidence, RunningItem
from batchgen.store.sqlfiles import query


def read(session: Session | Connection, window_s: float) -> Evidence:
    """Items running now and the models billed within the last ``window_s`` seconds."""
    running: list[RunningItem] = []
    billed: list[tuple[str, str | None]] = []
    for row in session.execute(query("gate_evidence"), {"window_s": window_s}):
        if row.kind == "running":
            running.append(
                RunningItem(
                    int(row.item_id),
                    int(row.attempt),
                    row.model,
                    row.deployment,
                    float(row.lease_left_s),
                )
            )
        else:
            billed.append((row.model, row.deployment))
    return Evidence(tuple(running), tuple(billed))
