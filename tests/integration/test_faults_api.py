"""The API process killed (SIGKILL) while it runs synchronous calls (issue #27 item 11,
issue #33 case 13).

A synchronous call runs in the API process that its caller is connected to; when
that process dies, the caller is gone with it. Its items must then end cancelled,
not be run again by a worker for nobody, and only a call the provider received may
be ledgered as billed (:func:`tests.invariants.check_invariants`), with the usage the
provider reported where its stream did.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import httpx
import psutil
import pytest
from sqlalchemy import select, text

from batchgen.domain.lifecycle.status import CALL_RANK
from batchgen.limits.backend import get_redis
from batchgen.store import db, sqlfiles
from batchgen.store.schema import Item, UsageLedger
from tests import http_client
from tests.helpers import FAULT_ENV, make_tenant, sim_config, sim_in_flight
from tests.invariants import (
    check_invariants,
    is_billed,
    reset_simulator,
    simulator_log,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CALLS = 6
# How long a caller's liveness outlasts its last renewal (the API's wait loop renews it).
CALLER_LEASE_S = 2.0


def _listening_pid(base_url: str) -> int:
    """The process group of the API's processes (gunicorn's master and its workers all
    listen on its port)."""
    port = int(base_url.rsplit(":", 1)[1])
    (group,) = {
        os.getpgid(c.pid)
        for c in psutil.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid
    }
    return int(group)


def _call_items() -> list[tuple[int, str]]:
    with db.session_scope() as s:
        rows = s.execute(
            select(Item.id, Item.status).where(Item.priority_rank == CALL_RANK).order_by(Item.id)
        )
        return [(row.id, row.status) for row in rows]


# What each streamed caller got before its API process died: an HTTP status, or the
# error that ended it; a test that waits on its calls says which of them went astray.
_OUTCOMES: list[str] = []


def _streamed_call(
    api: str, key: str, max_tokens: int, got_usage: threading.Event | None = None
) -> None:
    """One streamed call that asks for the usage chunk; ``got_usage`` is set once the
    caller has it (the API relays a chunk only after it has kept its usage)."""
    body = {
        "model": "sim-small",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {key}", "X-Request-Timeout": "120"}
    try:
        with http_client.stream(
            "POST",
            f"{api}/v1/chat/completions",
            content=json.dumps(body),
            headers={**headers, "Content-Type": "application/json"},
            timeout=120,
        ) as response:
            said = "" if response.status_code == 200 else response.read().decode()[:300]
            _OUTCOMES.append(f"HTTP {response.status_code} {said}".strip())
            for line in response.iter_lines():
                data = line.removeprefix("data: ")
                if got_usage and data.startswith("{") and json.loads(data).get("usage"):
                    got_usage.set()
    except httpx.HTTPError as exc:
        _OUTCOMES.append(type(exc).__name__)  # the API process is killed under it


def test_calls_of_a_killed_api_process_are_cancelled_not_rerun(
    simulator: Any, clean_db, workers, api_server
):
    reset_simulator(simulator.base_url)
    sim_config(simulator.base_url, latency_base_ms=2000)
    env = {**FAULT_ENV, "BATCHGEN_CALLER_LEASE_S": str(CALLER_LEASE_S)}
    workers(env=env, name="worker")
    api = api_server(env)
    key = make_tenant("apikill")
    try:
        callers = [
            threading.Thread(target=_streamed_call, args=(api, key, 20), daemon=True)
            for _ in range(CALLS)
        ]
        for caller in callers:
            caller.start()
        wait_until(lambda: sim_in_flight(simulator.base_url) == CALLS, 60, "the calls in flight")
        os.killpg(_listening_pid(api), signal.SIGKILL)
        for caller in callers:
            caller.join(30)
        wait_until(
            lambda: (
                len(_call_items()) == CALLS
                and all(
                    status in ("succeeded", "failed", "cancelled", "expired")
                    for _, status in _call_items()
                )
            ),
            60,
            "the killed API's calls to end",
        )
    finally:
        sim_config(simulator.base_url, latency_base_ms=50)

    ended = _call_items()
    assert {status for _, status in ended} == {"cancelled"}, ended
    per_item: dict[int, int] = {}
    for entry in simulator_log(simulator.base_url):
        per_item[int(entry["item"])] = per_item.get(int(entry["item"]), 0) + 1
    assert per_item == {item_id: 1 for item_id, _ in ended}, "a call was run again for nobody"
    check_invariants(simulator.base_url, get_redis(), worker_killed=True)


# The streamed calls of the test below: a few the provider finishes at once (3 tokens),
# the others still streaming (a token every 200 ms) when the API process is killed.
FINISHED, UNFINISHED = 3, 3
SHORT_TOKENS, LONG_TOKENS = 3, 300


def _ledger_rows() -> dict[int, list[Any]]:
    with db.session_scope() as s:
        rows = s.execute(
            select(UsageLedger)
            .join(Item, Item.id == UsageLedger.item_id)
            .where(Item.priority_rank == CALL_RANK)
        ).scalars()
        ledger: dict[int, list[Any]] = {}
        for row in rows:
            s.expunge(row)
            ledger.setdefault(row.item_id, []).append(row)
        return ledger


def _recording() -> list[int]:
    """The database sessions whose recording of an answer waits on a lock (the test's
    or queued behind another waiter's). The running leases' renewals wait there too
    and are left out. Read on a connection of its own, one statement each time: within
    a transaction (the lock's), PostgreSQL answers pg_stat_activity from the snapshot
    it took at the transaction's first look, and later waiters would never show."""
    with db.autocommit() as connection:
        return list(
            connection.scalars(
                text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                    " AND query NOT LIKE :renewal"
                ),
                {"renewal": _RENEWAL},
            )
        )


# A running lease's renewal (store.items.renew_leases): its text's first line, a pattern.
_RENEWAL = sqlfiles.source("item_extend_leases").split("\n", 1)[0] + "%"


def test_streamed_calls_of_a_killed_api_are_ledgered_with_the_providers_usage(
    simulator: Any, clean_db, workers, api_server
):
    """SIGKILL of the API process while it relays streamed calls: the provider finished
    some (their answers read, not yet recorded), the others were cut mid-stream. Every
    billed call gets exactly one ledger row: the provider's usage where its stream
    reported it, what the call reserved (marked as an estimate) otherwise; and the rows
    are written once the callers' presence lapses, before the calls' running leases
    would have run out."""
    reset_simulator(simulator.base_url)
    sim_config(simulator.base_url, latency_base_ms=6000, latency_per_token_ms=200)
    env = {
        "BATCHGEN_CALL_TIMEOUT_S": "120",
        "BATCHGEN_SWEEP_INTERVAL_S": "0.5",
        "BATCHGEN_CALLER_LEASE_S": str(CALLER_LEASE_S),
    }
    workers(env=env, name="worker")
    api = api_server(env)
    key = make_tenant("apikill-streams")
    usage_seen = [threading.Event() for _ in range(FINISHED)]
    callers = [
        threading.Thread(target=_streamed_call, args=(api, key, SHORT_TOKENS, seen), daemon=True)
        for seen in usage_seen
    ] + [
        threading.Thread(target=_streamed_call, args=(api, key, LONG_TOKENS), daemon=True)
        for _ in range(UNFINISHED)
    ]
    calls = FINISHED + UNFINISHED
    _OUTCOMES.clear()
    try:
        for caller in callers:
            caller.start()
        # Each call's item is locked here as soon as it is sent (and before its answer
        # can come back), so an answer the API has read cannot be recorded however far
        # apart the calls reach the provider on a loaded machine: the process dies
        # between the two.
        with db.session_scope() as lock:
            leases: dict[int, Any] = {}

            def lock_the_sent() -> bool:
                leases.update(
                    lock.execute(
                        select(Item.id, Item.lease_expires_at)
                        .where(Item.priority_rank == CALL_RANK, Item.sent_at.is_not(None))
                        .with_for_update()
                    ).all()
                )
                return len(leases) == calls

            wait_until(lock_the_sent, 60, lambda: f"the calls sent (callers got {_OUTCOMES})")
            for seen in usage_seen:
                assert seen.wait(60), "a short call's usage never reached its caller"
            recording = wait_until(
                lambda: got if len(got := _recording()) >= FINISHED else None,
                60,
                "the finished calls' records to wait on the lock",
            )
            os.killpg(_listening_pid(api), signal.SIGKILL)
            # Its database sessions die with it (as TCP keepalive would end them), before
            # their statements could go on once the lock is gone.
            lock.execute(
                text("SELECT pg_terminate_backend(pid) FROM unnest(:pids) AS pid"),
                {"pids": recording},
            )
        for caller in callers:
            caller.join(30)
        wait_until(
            lambda: (
                len(_ledger_rows()) == calls
                and all(status != "running" for _, status in _call_items())
            ),
            90,
            "the killed API's calls in the ledger",
        )
    finally:
        sim_config(simulator.base_url, latency_base_ms=50, latency_per_token_ms=0)

    log = {int(e["item"]): e for e in simulator_log(simulator.base_url)}
    assert sorted(log) == sorted(leases) and all(is_billed(e) for e in log.values())
    with db.session_scope() as s:
        reserved = dict(
            s.execute(
                select(Item.id, Item.prompt_tokens_est + Item.max_tokens).where(Item.id.in_(leases))
            ).all()
        )
    finished = sorted(i for i, e in log.items() if e["completed"])
    assert len(finished) == FINISHED, log
    assert {status for _, status in _call_items()} == {"cancelled"}  # none recorded
    for item_id, rows in _ledger_rows().items():
        (row,) = rows
        entry = log[item_id]
        if entry["completed"]:
            assert row.usage_source == "provider", item_id
            got = (row.prompt_tokens, row.completion_tokens)
            assert got == (entry["prompt_tokens"], entry["completion_tokens"])
            assert row.completion_tokens == SHORT_TOKENS
        else:
            assert row.usage_source == "estimate", item_id
            assert row.prompt_tokens + row.completion_tokens == reserved[item_id]
        # Ledgered on the API's liveness, not when the running lease ran out.
        assert row.created_at < leases[item_id], item_id
    check_invariants(simulator.base_url, get_redis(), worker_killed=True)
