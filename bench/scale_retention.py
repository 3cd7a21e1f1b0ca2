"""bench/scale.py's retention parts: one retention pass over the finished history (a
million items: results, ledger rows and all), timed, with the hot path's items per
second while it runs next to the same hot path alone; and retention's throughput
alone, its ticks back to back over expired synchronous calls and batches.

The hot path is the worker's PostgreSQL work for an item, run in a loop on a batch of
its own: a dispatch round, then per released item the claim that marks it sent and
the one statement that records its answer (result, ledger row, daily totals), as
:mod:`batchgen.worker.execution` runs them, with no provider call and no Redis.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from bench import history

HOT_WINDOW = 32
LEASE_S = 120.0


@dataclass
class Retention:
    batches: int
    items: int
    purge_s: float
    hot_alone_per_s: float
    hot_during_per_s: float


def _hot_batch(items_n: int) -> None:
    from batchgen import python_api
    from batchgen.config import get_settings
    from batchgen.store import db, tenants
    from bench.harness import chat_requests

    with db.session_scope() as session:
        tenants.create_tenant(session, "hot-path")
    per_batch = get_settings().submit.max_batch_lines
    for start in range(0, items_n, per_batch):
        rows = chat_requests(min(per_batch, items_n - start), history.MODEL, f"hot{start}")
        python_api.submit_batch(rows, tenant="hot-path", priority="bulk")


def hot_path(until: threading.Event | float) -> tuple[int, float]:
    """Run the hot path until ``until`` (a time.monotonic() deadline, or an event set);
    returns the items recorded and the seconds it ran."""
    from batchgen.registry import get_registry
    from batchgen.store import db, items, rounds
    from batchgen.store.ledger import CallOutcome, record_answer

    spec = get_registry()[history.MODEL]
    done, started = 0, time.monotonic()

    def going() -> bool:
        if isinstance(until, threading.Event):
            return not until.is_set()
        return time.monotonic() < until

    while going():
        with db.session_scope() as session:
            tickets = rounds.release(session, history.MODEL, HOT_WINDOW, LEASE_S)
        if not tickets:
            raise RuntimeError("the hot path's batch ran out: give it more items")
        with db.autocommit() as connection:
            for ticket in tickets:
                item = items.claim_sent(
                    connection, ticket, LEASE_S, time.monotonic(), claim_token=1
                )
                assert item is not None
                outcome = CallOutcome(
                    item_id=item.item_id,
                    attempt=item.attempt,
                    prompt_tokens=ticket.prompt_tokens_est,
                    completion_tokens=20,
                    response={"choices": [{"message": {"content": "x"}}]},
                )
                assert record_answer(connection, item, outcome, spec).recorded
                done += 1
    return done, time.monotonic() - started


def run(hot_items: int, alone_s: float) -> Retention:
    """Retention at half a day, over a history finished twenty hours ago, with the hot
    path beside it; the hot path alone for ``alone_s`` before and after the pass (the
    machine's load changes: the two are averaged)."""
    from batchgen.config import get_settings
    from batchgen.worker.retention_tick import purge

    _hot_batch(hot_items)
    hot_path(time.monotonic() + 2)  # warm
    before, took_before = hot_path(time.monotonic() + alone_s)

    os.environ["BATCHGEN_RETENTION_DAYS"] = "0.5"
    get_settings.cache_clear()
    stop, purged, timing = threading.Event(), [], []

    def retention() -> None:
        started = time.perf_counter()
        try:
            purged.append(purge(get_settings()))
        finally:
            timing.append(time.perf_counter() - started)
            stop.set()

    thread = threading.Thread(target=retention)
    thread.start()
    done, took = hot_path(stop)
    thread.join()
    del os.environ["BATCHGEN_RETENTION_DAYS"]
    get_settings.cache_clear()
    after, took_after = hot_path(time.monotonic() + alone_s)
    alone = (before + after) / (took_before + took_after)
    return Retention(purged[0].batches, purged[0].items, timing[0], alone, done / took)


@dataclass
class Ticks:
    ticks: int
    batches: int
    items: int
    purge_s: float


def ticks(libpq: str, calls: int, finished: int) -> Ticks:
    """Retention's own throughput: its ticks back to back, with the default settings
    (chunks and budget), over a history of ``calls`` synchronous calls (a batch each)
    and ``finished`` items in batches of 10 000, all of it expired."""
    from batchgen.config import get_settings
    from batchgen.worker.retention_tick import purge

    history.load(libpq, history.History(pending=0, finished=finished, calls=calls))
    os.environ["BATCHGEN_RETENTION_DAYS"] = "0.5"
    get_settings.cache_clear()
    done = Ticks(0, 0, 0, 0.0)
    try:
        while True:
            started = time.perf_counter()
            tick = purge(get_settings())
            done.purge_s += time.perf_counter() - started
            done.ticks += 1
            done.batches += tick.batches
            done.items += tick.items
            if not tick.budget_spent:
                return done
    finally:
        del os.environ["BATCHGEN_RETENTION_DAYS"]
        get_settings.cache_clear()
