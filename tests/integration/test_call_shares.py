"""Fair shares of a model's slots between tenants' synchronous calls (#27, item 4).

One tenant flooding parallel calls must not take every slot that frees: each
tenant's sync calls hold at most its weighted share of the model's slots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from batchgen.limits.backend import get_redis
from batchgen.limits.call_demand import demand_entry
from tests.helpers import chat_line, make_tenant, sim_config, sim_in_flight
from tests.invariants import wait_until
from tests.waiting import poll_until

pytestmark = pytest.mark.integration

MODEL = "sim-large"  # 8 slots
CALL_LATENCY_MS = 2000


class _Ticket:
    """What the gate reads of a sync call's item."""

    prompt_tokens_est, max_tokens, tenant_tokens_per_min, urgent = 10, 10, None, True

    def __init__(self, item_id: int, tenant_id: int, weight: int = 1) -> None:
        self.item_id, self.attempt = item_id, 1
        self.tenant_id, self.tenant_weight = tenant_id, weight


def test_a_tenant_at_its_share_leaves_the_freed_slot_to_another(clean_db):
    """Two slots, tenant 1's calls hold both and more wait: when one frees, tenant 1's
    next call is denied it (its share, with tenant 2 asking, is one) and tenant 2's call
    takes it; alone again, tenant 1 may use both."""
    from batchgen.config import Settings
    from batchgen.limits.gate import Gate, Pass, Wait
    from tests.integration.test_budget import spec

    gate = Gate(get_redis(), Settings(slot_wait_s=0.0))
    s = spec(tpm=1_000_000, rpm=1000, key="shares")  # two slots
    held = [gate.enter(s, _Ticket(n, tenant_id=1)) for n in (1, 2)]
    assert all(isinstance(p, Pass) for p in held)
    assert isinstance(gate.enter(s, _Ticket(3, tenant_id=1)), Wait)  # no slot free
    assert isinstance(gate.enter(s, _Ticket(20, tenant_id=2)), Wait)  # asks: share 1
    gate.settle(s, held[0], 1, 10)  # type: ignore[arg-type]
    assert isinstance(gate.enter(s, _Ticket(3, tenant_id=1)), Wait)  # at its share
    other = gate.enter(s, _Ticket(20, tenant_id=2))
    assert isinstance(other, Pass)
    gate.settle(s, other, 2, 10)
    gate.demand.forget(s.name, demand_entry(2, 1, 20))  # its call ended (python_api)
    assert isinstance(gate.enter(s, _Ticket(3, tenant_id=1)), Pass)  # alone: both


class _BulkTicket(_Ticket):
    urgent = False


def test_a_released_slot_leaves_no_holder_behind(clean_db):
    """The tenants of a model's slot holders (what the calls' shares count) lose each
    holder when its slot is released: a long backlog without calls leaves the hash as
    small as the slots held, not one entry per item that ever ran."""
    from batchgen.config import Settings
    from batchgen.limits import redis_keys as keys
    from batchgen.limits.gate import Gate, Pass
    from tests.integration.test_budget import spec

    gate = Gate(get_redis(), Settings(slot_wait_s=0.0, call_reserved_slots=0))
    s = spec(tpm=1_000_000, rpm=1000, key="holders")  # two slots
    for n in range(1, 21):  # twenty items, one after another
        entered = gate.enter(s, _BulkTicket(n, tenant_id=1 + n % 3))
        assert isinstance(entered, Pass)
        gate.settle(s, entered, 1, 10)  # type: ignore[arg-type]
    held = gate.enter(s, _BulkTicket(99, tenant_id=1))
    assert isinstance(held, Pass)
    assert get_redis().hkeys(keys.slot_tenants(s.name)) == [held.reservation_id.encode()]


def test_batch_work_denied_a_slot_shrinks_a_flooding_tenants_share(clean_db):
    """Tenant 1's calls hold both slots; tenant 2's batch item, denied a slot, asks for
    one: when a slot frees, tenant 1's waiting call is held to its share (one) and
    claims nothing, so the batch item takes the slot."""
    from batchgen.config import Settings
    from batchgen.limits.gate import Gate, Pass, Wait
    from tests.integration.test_budget import spec

    gate = Gate(get_redis(), Settings(slot_wait_s=0.0))
    s = spec(tpm=1_000_000, rpm=1000, key="batch-share")  # two slots
    held = [gate.enter(s, _Ticket(n, tenant_id=1)) for n in (1, 2)]
    assert all(isinstance(p, Pass) for p in held)
    batch_item = _Ticket(30, tenant_id=2)
    batch_item.urgent = False
    assert isinstance(gate.enter(s, batch_item), Wait)  # denied: it asks for a slot
    gate.settle(s, held[0], 1, 10)  # type: ignore[arg-type]
    assert isinstance(gate.enter(s, _Ticket(3, tenant_id=1)), Wait)  # at its share
    assert isinstance(gate.enter(s, batch_item), Pass)  # no claim stood in its way


def _call(client: httpx.Client, key: str, timeout_s: float | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if timeout_s is not None:
        headers["X-Request-Timeout"] = str(timeout_s)
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
    }
    return client.post("/v1/chat/completions", json=body, headers=headers, timeout=60)


@pytest.mark.slow
def test_a_flood_of_calls_leaves_another_tenant_its_share(
    clean_db, simulator, api_server: Callable[..., str], workers
):
    """Tenant A keeps 40 calls in flight on an 8-slot model whose calls take 2 s; B's
    calls, each with a 10 s deadline that the provider alone meets five times over, all
    succeed (before shares, B's call won about one slot in 41: 504s), and B's batch
    ends while the flood goes on (before, A's calls filled the dispatch window and
    their claims took every slot that freed: B's batch never started)."""
    from batchgen import python_api

    worker = workers(concurrency=2, wait=False)
    base_url = api_server()
    flood_key, calm_key = make_tenant("flood"), make_tenant("calm")
    worker.wait_ready()
    sim_config(simulator.base_url, latency_base_ms=CALL_LATENCY_MS)
    stop = threading.Event()
    flood_status: list[int] = []

    def flood() -> None:
        with httpx.Client(base_url=base_url) as client:
            while not stop.is_set():
                flood_status.append(_call(client, flood_key).status_code)

    calm: list[tuple[int, float]] = []
    with ThreadPoolExecutor(40) as pool:
        floods = [pool.submit(flood) for _ in range(40)]
        try:  # the flood stops whatever happens, so the pool's exit does not hang
            wait_until(lambda: sim_in_flight(simulator.base_url) >= 8, 30, "a full model")
            lines = [chat_line(f"b-{i}", model=MODEL, max_tokens=5) for i in range(8)]
            batch = python_api.submit_batch(lines, tenant="calm")
            with httpx.Client(base_url=base_url) as client:
                for _ in range(4):
                    started = time.monotonic()
                    answer = _call(client, calm_key, timeout_s=10)
                    calm.append((answer.status_code, time.monotonic() - started))
            ended = _batch_end(python_api, batch["id"], timeout_s=60)
            flooding = _open_calls("flood")
        finally:
            stop.set()
            for future in floods:
                future.result()
            sim_config(simulator.base_url, latency_base_ms=50)
    assert [status for status, _ in calm] == [200] * 4, calm
    assert ended["status"] == "completed" and ended["request_counts"]["succeeded"] == 8
    assert flooding >= 20  # the flood still had most of its calls open meanwhile
    assert flood_status and set(flood_status) == {200}  # the flood waits, no call is lost


def _open_calls(tenant: str) -> int:
    from sqlalchemy import func, select

    from batchgen.domain.lifecycle.status import CALL_RANK
    from batchgen.store import db
    from batchgen.store.schema import Item, Tenant

    with db.session_scope() as session:
        query = (
            select(func.count())
            .select_from(Item)
            .join(Tenant, Tenant.id == Item.tenant_id)
            .where(
                Tenant.name == tenant,
                Item.priority_rank == CALL_RANK,
                Item.status.in_(["pending", "queued", "running"]),
            )
        )
        return int(session.scalar(query) or 0)


def _batch_end(python_api: Any, batch_id: str, timeout_s: float) -> dict[str, Any]:
    """The batch once it ended, or as it stands after ``timeout_s``."""
    poll_until(
        lambda: python_api.get_batch(batch_id, tenant="calm")["status"] != "in_progress",
        timeout_s,
        poll_s=0.2,
    )
    described: dict[str, Any] = python_api.get_batch(batch_id, tenant="calm")
    return described


def test_a_tenant_whose_own_calls_fill_its_share_is_refused_at_once(clean_db, monkeypatch):
    """Ten open calls of its own on an 8-slot model whose calls take 2 s: the tenant's
    new call with a 3 s deadline would start after one round of its own calls, so it is
    a 429 (``tenant_over_share``, Retry-After 2) at once and nothing is stored; another
    tenant's call with the same deadline is taken."""
    from sqlalchemy import select

    from batchgen import python_api
    from batchgen.config import get_settings
    from batchgen.domain.formats.admission import CHAT_COMPLETIONS
    from batchgen.errors import OverShare
    from batchgen.registry import get_registry
    from batchgen.store import call_rows, db
    from batchgen.store.schema import Tenant
    from batchgen.worker import call_runner
    from batchgen.worker.packs import CallPace

    make_tenant("busy")
    make_tenant("calm")
    line = chat_line("call", model=MODEL, max_tokens=5)
    with db.session_scope() as session:
        busy = session.scalars(select(Tenant).where(Tenant.name == "busy")).one()
        for _ in range(10):
            call_rows.store_call(
                session,
                busy,
                line,
                deadline_s=600,
                endpoint=CHAT_COMPLETIONS,
                registry=get_registry(),
                settings=get_settings(),
            )
    pace = CallPace()
    pace.note(MODEL, 2.0)
    monkeypatch.setattr(call_runner, "pace", pace)
    with pytest.raises(OverShare) as refused:
        python_api.start_call(line, tenant="busy", endpoint=CHAT_COMPLETIONS, deadline_s=3)
    assert (refused.value.status_code, refused.value.retry_after_s) == (429, 2)
    assert refused.value.code == "tenant_over_share"
    assert _open_calls("busy") == 10  # nothing of the refused call was stored
    spec = get_registry()[MODEL]
    call_runner.refuse_early(spec, "calm", 3.0)  # within its share: taken


def test_the_fail_fast_rule_reads_demand_and_cooldowns_in_one_go(clean_db):
    """What the fail-fast rule reads of Redis (every tenant's demand and each
    deployment's cooldown) comes in one pipeline, also after Redis forgot its scripts
    (a flush): the demand is then read again on its own."""
    from batchgen.domain.scheduling.call_shares import Demand
    from batchgen.limits import redis_keys as keys
    from batchgen.limits.call_demand import CallDemand

    client = get_redis()
    demand = CallDemand(client)
    demand.read("shared", demand_entry(7, 2, 11))  # a call of tenant 7 waits
    client.set(keys.cooldown("shared-a"), "1", px=30_000)
    cooldowns = [keys.cooldown("shared-a"), keys.cooldown("shared-b")]
    for flushed in (False, True):
        if flushed:
            client.script_flush()
        read, ttls_ms = demand.read_with_ttls("shared", cooldowns)
        assert read == {7: Demand(weight=2, running=0, waiting=1)}
        assert ttls_ms[0] is not None and 0 < ttls_ms[0] <= 30_000
        assert ttls_ms[1] is None  # no cooldown on that deployment
