"""The worker under faults around one provider call: what is billed, what is kept.

Real PostgreSQL, Redis and the simulator over HTTP; one delivery is run in this
process with :func:`batchgen.worker.execution.run_item` where the test needs to look at a
single call, and in worker processes where a worker must die.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select, text, update
from sqlalchemy.exc import OperationalError

from batchgen import python_api as client
from batchgen.config import Settings, get_settings
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import get_redis
from batchgen.limits.gate import Gate, Pass
from batchgen.registry import Registry, parse_registry
from batchgen.store import db
from batchgen.store.schema import Batch, Item, Result, TenantDailyUsage, UsageLedger
from batchgen.worker.dispatch import release_all
from batchgen.worker.execution import NOT_SENT, run_item
from batchgen.worker.sweep import sweep
from tests import http_client
from tests.helpers import (
    assert_daily_usage_matches_ledger,
    assert_ledger_is_results_plus_waste,
    chat_line,
    make_tenant,
    models_file_with,
    usage_by_deployment_from_ledger,
    wait_batches,
)
from tests.tcp_proxy import proxy_for_postgres
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL_OF_KIND = {"openai": "sim-small", "anthropic": "sim-claude"}


@pytest.fixture(autouse=True)
def fresh_simulator(simulator: Any) -> None:
    """Item ids restart with every test: start with an empty request log."""
    http_client.post(f"{simulator.base_url}/_sim/reset").raise_for_status()


def _registry() -> Registry:
    """The shipped registry, pointing at this module's simulator (read now, not cached)."""
    path = Path(get_settings().paths.models_file)
    return parse_registry(path.read_text(encoding="utf-8"), str(path))


def _queue_one(registry: Registry, model: str, tenant: str, **line: object) -> int:
    """Submit one request and move it to ``queued``, as the dispatcher would; its id."""
    make_tenant(tenant)
    client.submit_batch([chat_line("only", model=model, **line)], tenant=tenant)
    with db.session_scope() as s:
        released = release_all(s, registry, get_settings())
    assert len(released) == 1
    return released[0].item_id


def _count(table: type, *where: object) -> int:
    with db.session_scope() as s:
        return int(s.scalar(select(func.count()).select_from(table).where(*where)) or 0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_refused_connection_is_not_billed(clean_db, simulator, kind, stream):
    """The provider's port refuses the TCP connection: nothing left the machine, so
    nothing is ledgered or counted, and the token reservation and the slot are freed."""
    registry = _registry()
    spec = registry[MODEL_OF_KIND[kind]]
    settings: Settings = get_settings().model_copy(update={"stream_calls": stream})
    item_id = _queue_one(registry, spec.name, f"refused-{kind}-{stream}")
    gate = Gate(get_redis(), settings)

    with simulator.refusing_connections():
        verdict = run_item(item_id, registry, settings, gate)

    assert verdict.outcome == "retry"  # a transient failure, retried later
    assert _count(UsageLedger) == 0
    assert _count(TenantDailyUsage) == 0
    assert gate.budget.used(spec) == (0, 0)  # the reservation was given back
    assert get_redis().zcard(keys.slots(spec.name)) == 0
    with db.session_scope() as s:
        item = s.get(Item, item_id)
        assert item is not None
        assert (item.status, item.error_code, item.sent_at) == ("pending", "transient", None)


# -- case 9: the concurrency slot is owned from enter() to settle() -------------------------

SENT_AT_FAILS = """
CREATE FUNCTION refuse_sent_at() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'database unavailable (test)' USING ERRCODE = 'connection_failure';
END $$;
CREATE TRIGGER refuse_sent_at BEFORE UPDATE OF sent_at ON items
FOR EACH ROW WHEN (NEW.sent_at IS NOT NULL) EXECUTE FUNCTION refuse_sent_at();
"""


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_first_calls_client_is_built_before_its_item_is_marked_sent(
    clean_db, simulator, monkeypatch, kind
):
    """A fresh process builds its SDK client on its first call (seconds of imports in
    an API process): that must happen before the item is marked sent, or a process
    killed meanwhile leaves a worker_lost waste row for a request that never left."""
    from batchgen import providers
    from batchgen.providers import anthropic as anthropic_adapter
    from batchgen.providers import openai as openai_adapter

    adapter = {"openai": openai_adapter, "anthropic": anthropic_adapter}[kind]
    registry = _registry()
    spec = registry[MODEL_OF_KIND[kind]]
    item_id = _queue_one(registry, spec.name, f"first-call-{kind}")
    monkeypatch.setattr(providers, "_WARMED", set(), raising=False)  # nothing built yet
    adapter.sdk_client.cache_clear()
    built = adapter.sdk_client
    sent_when_built: list[object] = []

    def building(*args: Any) -> Any:
        with db.session_scope() as s:
            item = s.get(Item, item_id)
            assert item is not None
            sent_when_built.append(item.sent_at)
        return built(*args)

    monkeypatch.setattr(adapter, "sdk_client", building)
    verdict = run_item(item_id, registry, get_settings(), Gate(get_redis(), get_settings()))
    assert verdict.outcome == "succeeded"
    assert sent_when_built and sent_when_built[0] is None, sent_when_built


@pytest.fixture
def sent_at_fails(clean_db) -> Iterator[None]:
    """Every claim that marks the item sent gets a real connection-class error."""
    with db.get_engine().begin() as conn:
        conn.execute(text(SENT_AT_FAILS))
    yield
    with db.get_engine().begin() as conn:
        conn.execute(text("DROP TRIGGER refuse_sent_at ON items; DROP FUNCTION refuse_sent_at()"))


def _assert_handed_back(item_id: int, spec_name: str, gate: Gate, registry: Registry) -> None:
    assert get_redis().zcard(keys.slots(spec_name)) == 0  # the slot is free at once
    with db.session_scope() as s:
        item = s.get(Item, item_id)
        assert item is not None
        assert (item.status, item.attempts, item.sent_at) == ("queued", 0, None)
    assert _count(UsageLedger) == 0


def test_slot_leaks_on_redis_error_inside_the_gate(clean_db, simulator):
    """Redis fails after the slot was taken (the budget reservation errors)."""
    registry = _registry()
    spec = registry["sim-small"]
    item_id = _queue_one(registry, spec.name, "slot-redis")
    gate = Gate(get_redis(), get_settings())
    # A real Redis error inside the reservation script: its hash is a string now.
    get_redis().set(keys.budget_amounts(spec.budget_key), "not a hash")
    with pytest.raises(redis.RedisError):
        run_item(item_id, registry, get_settings(), gate)
    _assert_handed_back(item_id, spec.name, gate, registry)


def test_slot_leaks_on_database_error_in_the_claim(sent_at_fails, simulator):
    """PostgreSQL fails when the item is claimed and marked sent, after the gate took the
    slot and the tokens: both come back, and the item is queued as before."""
    registry = _registry()
    spec = registry["sim-small"]
    item_id = _queue_one(registry, spec.name, "slot-db")
    gate = Gate(get_redis(), get_settings())
    with pytest.raises(OperationalError):
        run_item(item_id, registry, get_settings(), gate)
    _assert_handed_back(item_id, spec.name, gate, registry)
    assert gate.budget.used(spec) == (0, 0)  # nothing was sent: the reservation is back
    assert _count(TenantDailyUsage) == 0


# -- the message's ticket: the gate decides before the claim --------------------------------


def _released_ticket(registry: Registry, model: str, tenant: str) -> Any:
    """Submit one request and release it, as the dispatcher would; its ticket."""
    make_tenant(tenant)
    client.submit_batch([chat_line("only", model=model)], tenant=tenant)
    with db.session_scope() as s:
        (released,) = release_all(s, registry, get_settings())
    return released.ticket


def test_a_second_message_of_a_running_attempt_leaves_its_reservation_alone(clean_db, simulator):
    """Two messages of one item and attempt (a duplicate publish): the second finds the
    reservation held (it adopts it), claims nothing, and gives back nothing: neither the
    reservation nor the slot of the call in flight."""
    from batchgen.store import items

    registry = _registry()
    spec = registry["sim-small"]
    ticket = _released_ticket(registry, spec.name, "dup")
    gate = Gate(get_redis(), get_settings())
    first = gate.enter(spec, ticket)  # the first message's gate...
    assert isinstance(first, Pass) and not first.adopted
    with db.autocommit() as connection:  # ...and its claim: its call is in flight now
        token = items.new_claim_token()
        assert items.claim_sent(connection, ticket, 60.0, time.monotonic(), claim_token=token)
    in_flight = gate.budget.used(spec)
    assert in_flight[0] > 0 and get_redis().zcard(keys.slots(spec.name)) == 1

    verdict = run_item(
        ticket.item_id, registry, get_settings(), gate, model=spec.name, ticket=ticket
    )
    assert verdict.outcome == "skipped"
    assert gate.budget.used(spec) == in_flight  # the first call's reservation stands
    assert get_redis().zcard(keys.slots(spec.name)) == 1  # and so does its slot
    assert _sim_calls(simulator.base_url, ticket.item_id) == []
    # Nothing was sent after all: the owner gives it back.
    gate.settle_unsent(spec, first, ticket.tenant_id, ticket.max_tokens, NOT_SENT)
    assert gate.budget.used(spec) == (0, 0)
    assert get_redis().zcard(keys.slots(spec.name)) == 0


def test_a_late_duplicate_frees_the_slot_it_took_and_nothing_else(clean_db, simulator):
    """A duplicate message delivered after the call ended: it adopts the settled
    reservation (which stays, as the provider's charge) but takes a fresh slot; when its
    claim finds nothing, it frees that slot and leaves the budget as it was."""
    registry = _registry()
    spec = registry["sim-small"]
    ticket = _released_ticket(registry, spec.name, "late")
    gate = Gate(get_redis(), get_settings())
    done = run_item(ticket.item_id, registry, get_settings(), gate, model=spec.name, ticket=ticket)
    assert done.outcome == "succeeded"
    charged = gate.budget.used(spec)
    assert charged[0] > 0 and get_redis().zcard(keys.slots(spec.name)) == 0

    late = run_item(ticket.item_id, registry, get_settings(), gate, model=spec.name, ticket=ticket)
    assert late.outcome == "skipped"
    assert gate.budget.used(spec) == charged
    assert get_redis().zcard(keys.slots(spec.name)) == 0
    assert len(_sim_calls(simulator.base_url, ticket.item_id)) == 1


def test_a_gate_entered_by_a_worker_that_died_is_adopted_by_the_next_delivery(clean_db, simulator):
    """A worker entered the gate for an attempt and died before its claim (or Redis ran
    the script after the client gave up on its reply): the item is still queued for that
    attempt, and the next delivery adopts the reservation and the slot. One reservation
    stays on the books, for the one call that reached the provider."""
    registry = _registry()
    spec = registry["sim-small"]
    ticket = _released_ticket(registry, spec.name, "died")
    gate = Gate(get_redis(), get_settings())
    orphan = gate.enter(spec, ticket)  # ...and the process is gone
    assert isinstance(orphan, Pass)
    held = gate.budget.used(spec)

    verdict = run_item(
        ticket.item_id, registry, get_settings(), gate, model=spec.name, ticket=ticket
    )
    assert verdict.outcome == "succeeded"
    requests = gate.budget.used(spec)[1]
    assert requests == held[1] == 1  # one request on the books, not two
    members = [m.decode() for m in get_redis().zrange(keys.budget_log(spec.budget_key), 0, -1)]
    assert members == [f"{ticket.item_id}:{ticket.attempt}"]
    assert get_redis().zcard(keys.slots(spec.name)) == 0
    assert len(_sim_calls(simulator.base_url, ticket.item_id)) == 1


def test_a_stale_ticket_claims_nothing(clean_db, simulator):
    """A message whose attempt is not the item's next one (the item moved on since it
    was published) claims nothing and gives its reservation back."""
    import dataclasses

    registry = _registry()
    spec = registry["sim-small"]
    ticket = _released_ticket(registry, spec.name, "stale")
    stale = dataclasses.replace(ticket, attempt=ticket.attempt + 1)
    gate = Gate(get_redis(), get_settings())
    verdict = run_item(
        ticket.item_id, registry, get_settings(), gate, model=spec.name, ticket=stale
    )
    assert verdict.outcome == "skipped"
    _assert_handed_back(ticket.item_id, spec.name, gate, registry)
    assert gate.budget.used(spec) == (0, 0)
    # The right ticket still runs the item.
    verdict = run_item(
        ticket.item_id, registry, get_settings(), gate, model=spec.name, ticket=ticket
    )
    assert verdict.outcome == "succeeded"


# -- case 2: a paid answer survives a database outage while the lease lasts ----------------

RECORD_RETRY_LINE = "database error recording the result"


def _sim_calls(sim_url: str, item_id: int) -> list[dict[str, Any]]:
    return list(http_client.get(f"{sim_url}/_sim/log", params={"item": str(item_id)}).json())


@pytest.mark.slow
def test_paid_answer_survives_database_outage(clean_db, simulator, workers):
    """PostgreSQL becomes unreachable while the provider answers: the worker keeps the
    answer and records it once the database is back (one call, one ledger row)."""
    proxy, proxied = proxy_for_postgres(clean_db["DATABASE_URL"])
    http_client.post(f"{simulator.base_url}/_sim/config", json={"latency_base_ms": 1500})
    try:
        make_tenant("outage")
        batch = client.submit_batch([chat_line("o0")], tenant="outage")
        with db.session_scope() as s:
            item_id = s.scalar(select(Item.id))
        worker = workers(
            concurrency=2,
            env={
                "DATABASE_URL": proxied,
                "BATCHGEN_CALL_TIMEOUT_S": "5",
                "BATCHGEN_RUNNING_LEASE_MARGIN_S": "1",
                "BATCHGEN_SWEEP_INTERVAL_S": "0.5",
            },
        )
        wait_until(lambda: _sim_calls(simulator.base_url, item_id), 30, "the provider call")
        proxy.cut()  # the provider is answering now; the database is gone
        try:
            wait_until(
                lambda: worker.log_tail(1_000_000).count(RECORD_RETRY_LINE) >= 6,
                15,
                "the worker to keep retrying the record",
            )
        finally:
            proxy.restore()
        wait_batches([batch["id"]], timeout_s=60)
    finally:
        http_client.post(f"{simulator.base_url}/_sim/config", json={"latency_base_ms": 50})
        proxy.stop()

    assert len(_sim_calls(simulator.base_url, item_id)) == 1  # paid once
    with db.session_scope() as s:
        item = s.get(Item, item_id)
        assert item is not None
        assert (item.status, item.attempts) == ("succeeded", 1)
    assert _count(UsageLedger) == 1
    assert_ledger_is_results_plus_waste()
    assert get_redis().zcard(keys.slots("sim-small")) == 0  # the gate was settled


# -- case 10: deadlines on one clock (the database's), not the worker host's ---------------


@pytest.mark.parametrize("offset_s", [100.0, -60.0], ids=["ahead-100s", "behind-60s"])
def test_deadlines_not_on_the_worker_clock(clean_db, simulator, monkeypatch, offset_s):
    """The worker host's clock is off by ``offset_s``. Ahead, calls still get the time
    left (not 0); behind, a call is cut at the deadline, not 60 s later."""
    from batchgen.domain.lifecycle import deadlines

    real = deadlines.host_now
    monkeypatch.setattr(deadlines, "host_now", lambda: real() + dt.timedelta(seconds=offset_s))
    registry = _registry()
    ahead = offset_s > 0
    window = "30s" if ahead else "4s"
    latency_ms = 50 if ahead else 8000  # behind: the answer comes after the deadline
    http_client.post(f"{simulator.base_url}/_sim/config", json={"latency_base_ms": latency_ms})
    try:
        item_id = _queue_one(registry, "sim-small", f"clock{offset_s:+.0f}", max_tokens=20)
        with db.session_scope() as s:
            s.execute(
                update(Item)  # the deadline, on PostgreSQL's clock
                .where(Item.id == item_id)
                .values(deadline_at=func.now() + dt.timedelta(seconds=float(window[:-1])))
            )
            deadline_at = s.scalar(select(Item.deadline_at).where(Item.id == item_id))
        verdict = run_item(item_id, registry, get_settings(), Gate(get_redis(), get_settings()))
    finally:
        http_client.post(f"{simulator.base_url}/_sim/config", json={"latency_base_ms": 50})
    calls = _sim_calls(simulator.base_url, item_id)
    assert len(calls) == 1
    if ahead:
        assert verdict.outcome == "succeeded"
    else:
        assert verdict.outcome == "expired"
        assert calls[0]["completed"] is False  # the worker left before the late answer
        assert calls[0]["end_ts"] <= deadline_at.timestamp() + 1.0


# -- case 11: the sweep honours the model's own attempt cap --------------------------------


def _lose_lease(item_id: int, attempts: int, *, sent: bool) -> None:
    """The item's worker vanished: running, its lease over (sent or not)."""
    with db.session_scope() as s:
        s.execute(
            update(Item)
            .where(Item.id == item_id)
            .values(
                status="running",
                attempts=attempts,
                started_at=func.now(),
                sent_at=func.now() if sent else None,
                lease_expires_at=func.now() - dt.timedelta(seconds=1),
            )
        )


def test_sweep_honours_model_max_attempts(clean_db, simulator, restore_env, tmp_path):
    """A model capped at 2 attempts whose worker was lost on the 2nd: no 3rd call."""
    models = models_file_with(tmp_path / "models.toml", "sim-small", max_attempts=2)
    os.environ["BATCHGEN_MODELS_FILE"] = str(models)
    get_settings.cache_clear()
    assert get_settings().worker.max_attempts > 2  # the global cap alone would allow a third
    registry = _registry()
    item_id = _queue_one(registry, "sim-small", "capped")
    _lose_lease(item_id, attempts=2, sent=False)
    with db.session_scope() as s:
        report = sweep(s, get_settings())
    assert (report.failed, report.requeued) == (1, 0)
    with db.session_scope() as s:
        item = s.get(Item, item_id)
        assert item is not None
        assert (item.status, item.error_code) == ("failed", "worker_lost")


# -- case 22: sent => may be billed => ledgered, on every path -----------------------------


@pytest.mark.parametrize("cancelled", [False, True], ids=["requeued", "cancelled"])
def test_killed_worker_sent_calls_are_ledgered_by_the_sweep(clean_db, simulator, cancelled):
    """A running item whose call was sent loses its lease: the sweep ledgers the call as
    waste, once, at what it reserved (marked as an estimate: its usage never came
    back), and the daily usage follows the ledger."""
    registry = _registry()
    item_id = _queue_one(registry, "sim-small", "lost")
    _lose_lease(item_id, attempts=1, sent=True)
    if cancelled:
        with db.session_scope() as s:
            s.execute(update(Batch).values(cancel_requested_at=func.now()))
    for _ in range(2):  # a second sweep finds nothing more to ledger
        with db.session_scope() as s:
            sweep(s, get_settings())
    with db.session_scope() as s:
        rows = s.execute(
            select(
                UsageLedger.attempt,
                UsageLedger.waste_reason,
                UsageLedger.usage_source,
                UsageLedger.prompt_tokens + UsageLedger.completion_tokens,
            )
        ).all()
        item = s.get(Item, item_id)
        assert item is not None
        assert item.status == ("cancelled" if cancelled else "pending")
        reserved = item.prompt_tokens_est + item.max_tokens
    assert rows == [(1, "worker_lost", "estimate", reserved)]
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()


def test_lost_attempt_answer_turns_its_waste_row_into_the_result(clean_db, simulator):
    """The 'lost' worker was alive after all: its answer becomes the result, and the
    sweep's waste row for that same call becomes the result's row (never two rows)."""
    item_id = _lost_answer_recorded("alive")
    with db.session_scope() as s:
        rows = s.execute(
            select(
                UsageLedger.attempt,
                UsageLedger.waste_reason,
                UsageLedger.completion_tokens,
                UsageLedger.usage_source,
            )
        ).all()
        item = s.get(Item, item_id)
        assert item is not None and item.status == "succeeded"
        daily = s.execute(select(TenantDailyUsage.requests, TenantDailyUsage.prompt_tokens)).all()
    assert rows == [(1, None, 22, "provider")]  # the estimate made way for the answer
    assert daily == [(1, 11)]
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()


def _lost_answer_recorded(
    name: str, deployment: str | None = None, estimated_on: str | None = None
) -> int:
    """An item whose lease the sweep took back (ledgering its sent call as lost, on
    ``estimated_on``), then the answer of that call after all, from ``deployment``;
    returns the item's id."""
    from batchgen.store.ledger import CallOutcome, record_success

    registry = _registry()
    spec = registry["sim-small"]
    item_id = _queue_one(registry, "sim-small", name)
    _lose_lease(item_id, attempts=1, sent=True)
    with db.session_scope() as s:
        s.execute(update(Item).where(Item.id == item_id).values(deployment=estimated_on))
        sweep(s, get_settings())
    with db.session_scope() as s:
        answer = CallOutcome(
            item_id=item_id,
            attempt=1,
            prompt_tokens=11,
            completion_tokens=22,
            response={"choices": []},
            provider_request_id="req-1",
            upstream_latency_ms=5,
            queue_wait_ms=1,
            deployment=deployment,
        )
        assert record_success(s, answer, spec) is True
    return item_id


def test_a_lost_call_answered_by_another_deployment_moves_its_totals(clean_db, simulator):
    """The estimate's totals leave its deployment and its waste, the answer's go to the
    deployment that answered: the usage by deployment, from the totals, stays the
    ledger's."""
    item_id = _lost_answer_recorded("moved", deployment="second", estimated_on="first")
    with db.session_scope() as s:
        row = s.execute(select(UsageLedger.deployment, UsageLedger.waste_reason)).one()
    assert tuple(row) == ("second", None)
    (usage,) = client.usage(tenant=None, group_by="deployment")
    assert (usage["deployment"], usage["requests"], usage["wasted_requests"]) == ("second", 1, 0)
    assert client.usage(tenant=None, group_by="deployment") == usage_by_deployment_from_ledger()
    assert_daily_usage_matches_ledger()
    with db.session_scope() as s:
        assert s.get(Item, item_id).status == "succeeded"  # type: ignore[union-attr]


def _answer(item_id: int, attempt: int = 1) -> Any:
    from batchgen.store.ledger import CallOutcome

    return CallOutcome(
        item_id=item_id,
        attempt=attempt,
        prompt_tokens=11,
        completion_tokens=22,
        response={"choices": []},
        provider_request_id="req-1",
    )


def _table_counts() -> tuple[int, int, int]:
    return _count(UsageLedger), _count(Result), _count(Item, Item.status == "succeeded")


def test_one_statement_record_writes_only_for_the_running_attempt(clean_db, simulator):
    """The hot path's one-statement record: the running attempt's answer becomes the
    result with its ledger row and daily totals; a second record of it, and the answer of
    an attempt that is not the running one, write nothing (the general path decides)."""
    from batchgen.store import items
    from batchgen.store.ledger import record_answer

    registry = _registry()
    spec = registry["sim-small"]
    item_id = _queue_one(registry, "sim-small", "fast")
    with db.autocommit() as connection:
        claimed = items.claim(connection, item_id, 60.0)
    assert claimed is not None and claimed.attempt == 1
    with db.autocommit() as connection:
        stale = record_answer(connection, claimed, _answer(item_id, attempt=2), spec)
    assert not stale.recorded and _table_counts() == (0, 0, 0)
    with db.autocommit() as connection:
        first = record_answer(connection, claimed, _answer(item_id), spec)
    # The only item of its batch: nothing waits, nothing else runs.
    assert (first.recorded, first.waiting, first.running) == (True, False, False)
    assert _table_counts() == (1, 1, 1)
    with db.autocommit() as connection:
        again = record_answer(connection, claimed, _answer(item_id), spec)
    assert not again.recorded and _table_counts() == (1, 1, 1)
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()


def test_one_statement_record_leaves_a_lost_lease_to_the_general_path(clean_db, simulator):
    """The sweep ledgered the call as lost and requeued the item: the one statement
    writes nothing, and the general path turns the waste row into the result's row."""
    from batchgen.store import items
    from batchgen.store.ledger import record_answer, record_success

    registry = _registry()
    spec = registry["sim-small"]
    item_id = _queue_one(registry, "sim-small", "lost-fast")
    with db.autocommit() as connection:
        claimed = items.claim(connection, item_id, 60.0)
    assert claimed is not None
    _lose_lease(item_id, attempts=1, sent=True)
    with db.session_scope() as s:
        sweep(s, get_settings())
    assert _table_counts() == (1, 0, 0)  # the sweep's waste row
    with db.autocommit() as connection:
        assert not record_answer(connection, claimed, _answer(item_id), spec).recorded
    assert _table_counts() == (1, 0, 0)
    with db.session_scope() as s:
        assert record_success(s, _answer(item_id), spec) is True
    assert _table_counts() == (1, 1, 1)
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()


@pytest.mark.slow
def test_killed_worker_sent_calls_are_ledgered(clean_db, simulator, workers):
    """kill -9 of a worker mid-call: every call the simulator admitted (the provider may
    bill it) has a ledger row, matched per item with the simulator's own request log."""
    fast_leases = {
        "BATCHGEN_CALL_TIMEOUT_S": "5",
        "BATCHGEN_RUNNING_LEASE_MARGIN_S": "1",
        "BATCHGEN_QUEUED_LEASE_S": "8",
        "BATCHGEN_SWEEP_INTERVAL_S": "0.5",
    }
    http_client.post(f"{simulator.base_url}/_sim/config", json={"latency_base_ms": 700})
    try:
        make_tenant("kill")
        batch = client.submit_batch([chat_line(f"k{i}") for i in range(40)], tenant="kill")
        # The victim alone runs the batch until the kill: the calls in flight are its.
        victim = workers(concurrency=8, beat=True, env=fast_leases, name="victim")
        wait_until(lambda: "succeeded prompt_tokens" in victim.log_tail(200), 30, "a first answer")
        wait_until(lambda: _in_flight(simulator.base_url) >= 4, 10, "calls in flight")
        victim.kill()
        workers(concurrency=8, beat=True, env=fast_leases, name="survivor")
        wait_batches([batch["id"]], timeout_s=120)
    finally:
        http_client.post(f"{simulator.base_url}/_sim/config", json={"latency_base_ms": 50})

    admitted: dict[int, int] = {}
    for entry in http_client.get(f"{simulator.base_url}/_sim/log").json():
        if entry["admitted"] and entry["item"] is not None:
            admitted[int(entry["item"])] = admitted.get(int(entry["item"]), 0) + 1
    with db.session_scope() as s:
        ledgered = dict(
            s.execute(select(UsageLedger.item_id, func.count()).group_by(UsageLedger.item_id)).all()
        )
        retried = s.scalar(select(func.count()).select_from(Item).where(Item.attempts > 1))
    assert retried > 0  # the kill really hit calls in flight
    unledgered = {i: n for i, n in admitted.items() if ledgered.get(i, 0) < n}
    assert unledgered == {}, f"calls the provider admitted without a ledger row: {unledgered}"
    assert client.get_batch(batch["id"], tenant="kill")["request_counts"]["succeeded"] == 40
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()


def _in_flight(sim_url: str) -> int:
    return sum(1 for e in http_client.get(f"{sim_url}/_sim/log").json() if e["end_ts"] is None)


def test_a_lost_claim_reply_marks_that_claim_unsent(sent_at_fails, simulator):
    """The claim that marks the item sent fails (its reply may be lost with it
    committed, now or later): the worker sends nothing and says so in Redis, for the
    sweep, naming that very claim (its token), each try its own. A later claim of the
    same attempt number is another claim: no mark covers it, and if its call is lost
    the sweep ledgers it."""
    from batchgen.limits import liveness
    from batchgen.store import items

    registry = _registry()
    spec = registry["sim-small"]
    item_id = _queue_one(registry, spec.name, "claim-lost")
    with pytest.raises(OperationalError):
        run_item(item_id, registry, get_settings(), Gate(get_redis(), get_settings()))
    prefix = keys.unsent_claim(item_id, 0)[: -len("0")]
    tokens = [int(k.decode().removeprefix(prefix)) for k in get_redis().keys(f"{prefix}*")]
    assert len(set(tokens)) == 2  # the claim and its one retry, each under its own token
    assert liveness.unsent(get_redis(), [(item_id, t) for t in tokens]) == {item_id}
    assert liveness.unsent(get_redis(), [(item_id, items.new_claim_token())]) == set()
    with db.session_scope() as s:
        item = s.get(Item, item_id)
        assert item is not None and (item.status, item.attempts) == ("queued", 0)


@pytest.mark.parametrize("later", [True, False], ids=["another-workers-claim", "the-lost-claim"])
def test_a_lost_claims_hand_back_leaves_a_later_claim_of_the_same_attempt(clean_db, later):
    """A claim failed with a database error (its reply may be lost with it committed,
    even after the error was seen: PostgreSQL runs a statement its client gave up on):
    it is handed back by its token. Meanwhile the sweep may have taken the item back and
    another worker claimed the same attempt number: that claim stays running (else it
    would be claimed and paid twice)."""
    from batchgen.store import items
    from batchgen.worker.recording import LostClaim, give_back

    registry = _registry()
    item_id = _queue_one(registry, "sim-small", f"lost-claim-{later}")
    lost = items.new_claim_token()
    found = items.new_claim_token() if later else lost
    with db.session_scope() as s:  # the claim found running: attempt 1, sent
        s.execute(
            update(Item)
            .where(Item.id == item_id)
            .values(
                status="running",
                attempts=1,
                started_at=func.now(),
                sent_at=func.now(),
                claim_token=found,
            )
        )
    give_back(LostClaim(item_id, 1, time.monotonic() + 30, lost), get_settings())
    with db.session_scope() as s:
        item = s.get(Item, item_id)
        assert item is not None
        got = (item.status, item.attempts, item.sent_at is None)
    assert got == (("running", 1, False) if later else ("queued", 0, True))


@pytest.mark.parametrize("marked", ["this", "another", None], ids=["never-left", "other", "maybe"])
def test_the_sweep_ledgers_no_waste_for_an_attempt_that_never_left(clean_db, marked):
    """A running item marked sent whose lease ran out: waste (worker_lost) unless the
    worker of the claim that marked it sent marked that claim unsent (its reply was
    lost, PostgreSQL away). A mark of another claim (an earlier one of the same attempt
    number) does not count."""
    from batchgen.limits import liveness
    from batchgen.store import items

    registry = _registry()
    item_id = _queue_one(registry, "sim-small", f"sweep-unsent-{marked}")
    token = items.new_claim_token()
    with db.session_scope() as s:
        s.execute(
            update(Item)
            .where(Item.id == item_id)
            .values(
                status="running",
                attempts=1,
                started_at=func.now(),
                sent_at=func.now(),
                lease_expires_at=func.now() - dt.timedelta(seconds=1),
                claim_token=token,
            )
        )
    if marked is not None:
        named = token if marked == "this" else items.new_claim_token()
        liveness.mark_unsent(get_redis(), item_id, named, 60)
    with db.session_scope() as s:
        sweep(s, get_settings(), registry)
    with db.session_scope() as s:
        item = s.get(Item, item_id)
        assert item is not None and item.status == "pending"
    assert _count(UsageLedger, UsageLedger.item_id == item_id) == (0 if marked == "this" else 1)
