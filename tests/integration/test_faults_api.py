"""The API process killed (SIGKILL) while it runs synchronous calls (issue #27 item 11).

A synchronous call runs in the API process that its caller is connected to; when
that process dies, the caller is gone with it. Its items must then end cancelled,
not be run again by a worker for nobody, and only a call the provider received may
be ledgered as billed (:func:`tests.invariants.check_invariants`).
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
from sqlalchemy import select

from batchgen.domain.status import CALL_RANK
from batchgen.limits.backend import get_redis
from batchgen.store import db
from batchgen.store.schema import Item
from tests.helpers import FAULT_ENV, make_tenant, sim_config, sim_in_flight
from tests.invariants import check_invariants, reset_simulator, simulator_log, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CALLS = 6
# How long a caller's liveness outlasts its last renewal (the API's wait loop renews it).
CALLER_LEASE_S = 2.0


def _listening_pid(base_url: str) -> int:
    port = int(base_url.rsplit(":", 1)[1])
    (pid,) = {
        c.pid
        for c in psutil.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
    }
    return int(pid)


def _call_items() -> list[tuple[int, str]]:
    with db.session_scope() as s:
        rows = s.execute(
            select(Item.id, Item.status).where(Item.priority_rank == CALL_RANK).order_by(Item.id)
        )
        return [(row.id, row.status) for row in rows]


def test_calls_of_a_killed_api_process_are_cancelled_not_rerun(
    simulator: Any, clean_db, workers, api_server
):
    reset_simulator(simulator.base_url)
    sim_config(simulator.base_url, latency_base_ms=2000)
    env = {**FAULT_ENV, "BATCHGEN_CALLER_LEASE_S": str(CALLER_LEASE_S)}
    workers(env=env, name="worker")
    api = api_server(env)
    key = make_tenant("apikill")
    body = {
        "model": "sim-small",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 20,
        "stream": True,
    }

    def call() -> None:
        headers = {"Authorization": f"Bearer {key}", "X-Request-Timeout": "60"}
        try:
            with httpx.stream(
                "POST",
                f"{api}/v1/chat/completions",
                content=json.dumps(body),
                headers={**headers, "Content-Type": "application/json"},
                timeout=60,
            ) as response:
                for _ in response.iter_bytes():
                    pass
        except httpx.HTTPError:
            pass  # the API process is killed under it

    try:
        callers = [threading.Thread(target=call, daemon=True) for _ in range(CALLS)]
        for caller in callers:
            caller.start()
        wait_until(lambda: sim_in_flight(simulator.base_url) == CALLS, 30, "the calls in flight")
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
