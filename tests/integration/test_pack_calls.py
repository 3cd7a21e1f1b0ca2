"""Packs run as a group (app/worker/pack_calls.py): one gate script call, one claim
statement, one record statement (a group commit) and one settle call for a pack's
items, whose calls overlap when they are slow.

Real PostgreSQL, Redis and the simulator over HTTP. A pack is run in this process where
the test counts its round trips, and by worker processes where calls must overlap
inside messages, the model's slots must hold across them, or a worker must die with a
pack's calls in flight.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.limits.backend import get_redis
from batchgen.limits.gate import Gate
from batchgen.registry import Registry, parse_registry
from batchgen.store import db
from batchgen.store.schema import Item, Result, UsageLedger
from batchgen.store.sqlfiles import driver_query
from batchgen.worker.dispatch import release_model
from batchgen.worker.pack_calls import run_together
from batchgen.worker.packs import PackItem
from tests import http_client
from tests.helpers import (
    FAULT_ENV,
    FAULT_RUNNING_LEASE_S,
    assert_daily_usage_matches_ledger,
    assert_ledger_is_results_plus_waste,
    chat_line,
    make_tenant,
    sim_config,
    submit_items,
    wait_batches,
)
from tests.invariants import check_invariants, reset_simulator, wait_until

pytestmark = pytest.mark.integration

MODEL = "sim-small"


@pytest.fixture
def sim(simulator: Any, clean_db: dict[str, str]) -> Any:
    """The module's simulator with an empty request log, answering at once."""
    reset_simulator(simulator.base_url)
    sim_config(simulator.base_url, latency_base_ms=0, latency_per_token_ms=0)
    yield simulator
    sim_config(simulator.base_url, latency_base_ms=50, latency_per_token_ms=0.5)


def _registry() -> Registry:
    path = Path(get_settings().paths.models_file)
    return parse_registry(path.read_text(encoding="utf-8"), str(path))


def _released_pack(tenant: str, n: int, registry: Registry) -> list[Any]:
    """``n`` items of one batch, released (queued) as the dispatcher would."""
    make_tenant(tenant)
    lines = [chat_line(f"{tenant}-{i}") for i in range(n)]
    client.submit_batch(lines, tenant=tenant)
    with db.session_scope() as s:
        released = release_model(s, registry[MODEL], get_settings())
    assert len(released) == n
    return released


def _run_pack(
    released: list[Any],
    spec: Any,
    settings: Any,
    overlap: bool = False,
    note: Any = lambda verdict: None,
    rounds: int | None = None,
) -> Any:
    """``released`` run as one pack (``rounds``: one after another in rounds of that many)."""
    return run_together(
        [PackItem(r.item_id, r.ticket.to_message()) for r in released],
        spec,
        [r.ticket for r in released],
        settings,
        Gate(get_redis(), settings),
        None,
        overlap,
        note,
        rounds,
    )


class Trips:
    """The round trips a pack makes: statements on psycopg (by name), and Redis
    script calls (by script, with their entries)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        from batchgen.limits import budget

        self.statements: list[str] = []
        self.script_calls: list[tuple[str, int]] = []
        self.then: list[str] = []  # commands sent after a script call
        names = {
            driver_query(n, binary): n
            for binary in (False, True)
            for n in (
                "item_claim_sent",
                "item_claim_sent_many",
                "item_succeed_answered",
                "item_succeed_answered_many",
            )
        }
        real_rows, real_at_once = db.driver_rows, budget.scripts_at_once

        def rows(connection: Any, statement: str, params: Any) -> Any:
            self.statements.append(names.get(statement, "other"))
            return real_rows(connection, statement, params)

        def at_once(client_: Any, name: str, calls: list[Any], then: Any = ()) -> Any:
            self.script_calls.append((name, len(calls)))
            self.then += [command[0] for command in then]
            return real_at_once(client_, name, calls, then)

        monkeypatch.setattr(db, "driver_rows", rows)
        monkeypatch.setattr(budget, "scripts_at_once", at_once)


@pytest.mark.parametrize("overlap", [False, True], ids=["one-after-another", "overlapping"])
def test_a_pack_enters_claims_records_and_settles_its_items_together(sim, monkeypatch, overlap):
    """Six items of one pack: their gate entries go in one script call (calls one after
    another: the first takes the pack's slot, then the rest in one more), their claims
    in one statement, their answers in one statement per group of answers that came
    back together, their settlements in one script call per group; nothing item by item.
    Every item succeeds once, ledger and daily totals agree."""
    if overlap:
        sim_config(sim.base_url, latency_base_ms=300)  # calls that overlap end together
    registry = _registry()
    spec, settings = registry[MODEL], get_settings()
    released = _released_pack("together", 6, registry)
    trips = Trips(monkeypatch)
    verdicts = []
    outcome = _run_pack(released, spec, settings, overlap, verdicts.append)

    assert outcome.error is None and not outcome.waiting and not outcome.handed_back
    assert (
        [v.outcome for v in outcome.verdicts] == ["succeeded"] * 6 == [v.outcome for v in verdicts]
    )
    assert sorted(outcome.ran or []) == sorted(r.item_id for r in released)
    hot = [s for s in trips.statements if s != "other"]
    assert hot.count("item_claim_sent_many") == 1
    assert "item_claim_sent" not in hot and "item_succeed_answered" not in hot
    groups = hot.count("item_succeed_answered_many")
    enters = [n for name, n in trips.script_calls if name == "budget_reserve"]
    settles = [n for name, n in trips.script_calls if name == "budget_settle"]
    assert enters == ([6] if overlap else [1, 5])
    assert sum(settles) == 6
    if not overlap:
        assert groups == 1 and len(settles) == 1
        assert trips.then == []  # one slot, freed at the end: no other pack waits for it
    else:  # settled as they end; recorded together when they end close together
        assert 1 <= groups <= len(settles) <= 6
        # Each settle call tells the other processes' waiting packs its slots freed.
        assert trips.then == ["PUBLISH"] * len(settles)
        stats = http_client.get(f"{sim.base_url}/_sim/stats").json()
        assert stats["max_in_flight"] >= 2, "a pack's calls did not overlap"
    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Result)) == 6
        statuses = set(s.scalars(select(Item.status)))
        assert statuses == {"succeeded"}
    assert http_client.get(f"{sim.base_url}/_sim/stats").json()["requests"] == 6
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()


def test_a_slot_frees_as_its_call_ends_and_its_answer_is_recorded_meanwhile(sim):
    """Two overlapping calls of one pack, one quick (one token), one slow (its tokens
    paced to take 10 s): the quick call's slot is freed as it ends and its answer
    recorded while the slow call still runs (it waits RECORD_GATHER_S at most for the
    pack's other calls), then the slow one's. Each item succeeds once; no slot is left
    held."""
    import threading

    from batchgen.limits import redis_keys as keys
    from batchgen.simulator.text import completion_text

    slow_text = [{"role": "user", "content": "Describe product ends-slow."}]
    slow_tokens = completion_text(slow_text, 400)[1]
    sim_config(sim.base_url, latency_base_ms=50, latency_per_token_ms=10_000 / slow_tokens)
    registry = _registry()
    spec, settings = registry[MODEL], get_settings()
    make_tenant("ends")
    lines = [chat_line("ends-quick", max_tokens=1), chat_line("ends-slow", max_tokens=400)]
    client.submit_batch(lines, tenant="ends")
    with db.session_scope() as s:
        released = release_model(s, spec, settings)
    quick, slow = sorted(released, key=lambda r: r.item_id)
    outcome: list[Any] = []
    runner = threading.Thread(
        target=lambda: outcome.append(
            run_together(
                [PackItem(r.item_id, r.ticket.to_message()) for r in (quick, slow)],
                spec,
                [quick.ticket, slow.ticket],
                settings,
                Gate(get_redis(), settings),
                None,
                True,
                lambda _: None,
            )
        )
    )
    runner.start()

    def status(item_id: int) -> str:
        with db.session_scope() as s:
            return str(s.scalar(select(Item.status).where(Item.id == item_id)))

    def slots_held() -> int:
        return int(get_redis().zcard(keys.slots(spec.name)))

    wait_until(lambda: status(quick.item_id) == "succeeded", 30, "the quick answer recorded")
    # The slow call is still at the provider: its slot alone is held, its item runs.
    assert status(slow.item_id) == "running"
    assert slots_held() == 1
    assert http_client.get(f"{sim.base_url}/_sim/stats").json()["in_flight"] == 1
    runner.join(timeout=60)
    assert not runner.is_alive()
    assert outcome and outcome[0].error is None
    assert [v.outcome for v in outcome[0].verdicts] == ["succeeded", "succeeded"]
    assert status(slow.item_id) == "succeeded" and slots_held() == 0
    assert_ledger_is_results_plus_waste()


@pytest.mark.parametrize("max_s", [120.0, 0.0], ids=["all-rounds", "out-of-time"])
def test_short_calls_go_in_rounds_and_a_pack_out_of_time_hands_the_rest_back(
    sim, monkeypatch, max_s
):
    """Six short calls in rounds of two: each round entered (the first item takes the
    slot, the other its budget), claimed, recorded and settled together. A pack that has
    run its time (pack_max_s; here 0) with calls no longer short (here: a target of
    almost 0) begins no other round: the items of the rounds not begun are handed back
    untried, still queued, and nothing was sent for them."""
    registry = _registry()
    spec = registry[MODEL]
    # The host's CPUs left out: a busy test machine would keep the rest.
    slow = {"pack_max_s": 0.0, "pack_target_s": 1e-9, "pack_busy_host_keeps_rest": False}
    settings = get_settings().model_copy(update=slow if max_s == 0 else {"pack_max_s": max_s})
    released = _released_pack("rounds", 6, registry)
    trips = Trips(monkeypatch)
    outcome = _run_pack(released, spec, settings, rounds=2)

    rounds = 3 if max_s else 1
    assert outcome.error is None and not outcome.waiting
    assert [v.outcome for v in outcome.verdicts] == ["succeeded"] * 2 * rounds
    hot = [s for s in trips.statements if s != "other"]
    assert hot.count("item_claim_sent_many") == rounds
    assert hot.count("item_succeed_answered_many") == rounds
    assert [n for name, n in trips.script_calls if name == "budget_reserve"] == [1, 1] * rounds
    assert [n for name, n in trips.script_calls if name == "budget_settle"] == [2] * rounds
    ids = [r.item_id for r in released]
    assert [p.item_id for p in outcome.handed_back] == ids[2 * rounds :]
    with db.session_scope() as s:
        statuses = dict(s.execute(select(Item.id, Item.status)).all())
    assert [statuses[i] for i in ids] == ["succeeded"] * 2 * rounds + ["queued"] * (6 - 2 * rounds)
    assert http_client.get(f"{sim.base_url}/_sim/stats").json()["requests"] == 2 * rounds
    assert_ledger_is_results_plus_waste()


def test_a_pack_out_of_time_keeps_its_rest_while_the_models_slots_are_held(sim):
    """The same pack out of time with calls no longer short, but every other slot of
    the model held by calls elsewhere (its own round takes the last one): a rest handed
    back could not run alongside anything, so the pack runs all its rounds itself."""
    from batchgen.domain.lifecycle.decisions import room_for_overlap
    from batchgen.limits.concurrency import Slots

    registry = _registry()
    spec = registry[MODEL]
    slow = {"pack_max_s": 0.0, "pack_target_s": 1e-9, "pack_busy_host_keeps_rest": False}
    settings = get_settings().model_copy(update=slow)
    others = spec.max_concurrency - 1
    assert not room_for_overlap(others, spec.max_concurrency, settings.packs.max_items)
    slots = Slots(get_redis())
    for k in range(others):
        assert slots.acquire(MODEL, f"elsewhere-{k}", spec.max_concurrency, 60.0)
    released = _released_pack("roundsheld", 6, registry)
    outcome = _run_pack(released, spec, settings, rounds=2)

    assert outcome.error is None and not outcome.waiting and not outcome.handed_back
    assert [v.outcome for v in outcome.verdicts] == ["succeeded"] * 6
    assert slots.held(MODEL) == others  # its own slot given back after each round
    assert http_client.get(f"{sim.base_url}/_sim/stats").json()["requests"] == 6
    assert_ledger_is_results_plus_waste()


def test_a_group_commit_records_only_the_running_attempts(sim):
    """A group of answers in one statement: the answers of attempts that still run their
    items are recorded (ledger, result, daily totals, succeeded); one whose attempt does
    not run (a stale answer) and one recorded already write nothing; ledger and totals
    agree."""
    from batchgen.store import items
    from batchgen.store.ledger import CallOutcome, record_answers

    registry = _registry()
    spec = registry[MODEL]
    released = _released_pack("group", 4, registry)
    with db.autocommit() as connection:
        claimed = items.claim_sent_many(
            connection, [(r.ticket, None) for r in released], 60.0, 0.0, claim_token=1
        )
    assert sorted(claimed) == sorted(r.item_id for r in released)
    assert all(c.attempt == 1 for c in claimed.values())
    first, second, third, fourth = (claimed[r.item_id] for r in released)

    def answer(item: Any, attempt: int = 1) -> CallOutcome:
        return CallOutcome(
            item_id=item.item_id,
            attempt=attempt,
            prompt_tokens=11,
            completion_tokens=22,
            response={"choices": []},
            provider_request_id=f"req-{item.item_id}",
        )

    with db.autocommit() as connection:
        once = record_answers(connection, [(first, answer(first), spec)])
    assert once[first.item_id].recorded and once[first.item_id].waiting is False
    with db.autocommit() as connection:
        found = record_answers(
            connection,
            [
                (first, answer(first), spec),  # recorded already
                (second, answer(second, attempt=2), spec),  # not the running attempt
                (third, answer(third), spec),
                (fourth, answer(fourth), spec),
            ],
        )
    assert {i: a.recorded for i, a in found.items()} == {
        first.item_id: False,
        second.item_id: False,
        third.item_id: True,
        fourth.item_id: True,
    }
    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(UsageLedger)) == 3
        assert s.scalar(select(func.count()).select_from(Result)) == 3
        running = s.scalar(select(Item.status).where(Item.id == second.item_id))
    assert running == "running"
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()


def test_a_stale_ticket_in_a_pack_claims_nothing_and_the_rest_is_claimed(sim):
    """One statement claims a pack: an item whose message carries a stale attempt is
    left out, the others are claimed and marked sent."""
    from dataclasses import replace

    from batchgen.store import items

    registry = _registry()
    released = _released_pack("stale", 3, registry)
    tickets = [r.ticket for r in released]
    tickets[1] = replace(tickets[1], attempt=tickets[1].attempt + 1)
    with db.autocommit() as connection:
        claimed = items.claim_sent_many(
            connection, [(t, "d1") for t in tickets], 60.0, 0.0, claim_token=1
        )
    assert sorted(claimed) == sorted([tickets[0].item_id, tickets[2].item_id])
    with db.session_scope() as s:
        rows = dict(s.execute(select(Item.id, Item.sent_at.is_not(None))).all())
    assert rows == {tickets[0].item_id: True, tickets[1].item_id: False, tickets[2].item_id: True}


def _unacked_packs() -> list[list[int]]:
    packs = []
    for raw in get_redis().hvals("unacked"):
        payload = json.loads(raw)[0]
        if payload.get("headers", {}).get("task") != "batchgen.generate":
            continue
        args, kwargs, _ = json.loads(base64.b64decode(payload["body"]))
        if kwargs.get("more"):
            packs.append([int(args[0]), *(int(i) for i, _ in kwargs["more"])])
    return packs


def _max_in_flight(sim_url: str) -> int:
    return int(http_client.get(f"{sim_url}/_sim/stats").json()["max_in_flight"])


def test_slow_calls_overlap_inside_messages_and_the_slots_hold(sim, workers):
    """200 ms calls, one worker process of 2 threads, the model's 16 slots: packs run
    as groups put more calls in flight than the process has threads (their calls
    overlap), never more than the model's slots; every item succeeds once and the
    ledger matches the simulator's log."""
    sim_config(sim.base_url, latency_base_ms=200)
    n = 120
    batch_id = submit_items("overlap", n)
    workers(concurrency=2)
    wait_batches([batch_id], timeout_s=180)

    cap = _registry()[MODEL].max_concurrency
    in_flight = _max_in_flight(sim.base_url)
    assert 2 < in_flight <= cap, f"{in_flight} calls in flight at most"
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": n}
    assert report.billed_calls == n and report.retried_items == 0


def _packs_in_flight() -> list[list[int]]:
    """Packs a worker holds whose items include at least two running and sent at once."""
    packs = _unacked_packs()
    if not packs:
        return []
    with db.session_scope() as s:
        sent = set(
            s.scalars(
                select(Item.id).where(
                    Item.id.in_([i for p in packs for i in p]),
                    Item.status == "running",
                    Item.sent_at.is_not(None),
                )
            )
        )
    return [[i for i in p if i in sent] for p in packs if len(sent & set(p)) >= 2]


def test_a_worker_killed_with_a_packs_calls_in_flight_loses_nothing(sim, workers):
    """SIGKILL a worker while a pack's calls are in flight together (several items of one
    message claimed and sent): the sweep ledgers each of those calls once, as lost, when
    its running lease runs out, and another worker runs the items again. Every item
    succeeded once; every billed call is in the ledger once."""
    sim_config(sim.base_url, latency_base_ms=800)
    # Beyond the dispatcher's first window (2x the model's 16 slots, one item a message):
    # the rest goes out in the victim's refills, packs of overlapping calls.
    n = 72
    batch_id = submit_items("packfly", n)
    victim = workers(concurrency=2, env=FAULT_ENV, name="victim")
    flying = wait_until(_packs_in_flight, 90, "a pack's calls in flight", poll_s=0.01)
    victim.kill()
    assert victim.process.poll() is not None
    workers(concurrency=4, env=FAULT_ENV, name="survivor")
    wait_batches([batch_id], timeout_s=180)

    report = check_invariants(
        sim.base_url, get_redis(), slot_grace_s=FAULT_RUNNING_LEASE_S, worker_killed=True
    )
    assert report.statuses == {"succeeded": n}
    killed = [i for p in flying for i in p]
    with db.session_scope() as s:
        attempts = dict(s.execute(select(Item.id, Item.attempts).where(Item.id.in_(killed))).all())
        lost = set(
            s.scalars(
                select(UsageLedger.item_id).where(
                    UsageLedger.item_id.in_(killed), UsageLedger.attempt == 1
                )
            )
        )
    print(f"\npack kill: {len(killed)} calls of packs in flight at the kill")
    # Sent at the kill: their first attempt is ledgered (lost or answered), once.
    assert lost == set(killed)
    assert all(a >= 1 for a in attempts.values())
