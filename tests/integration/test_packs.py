"""Packs: a model's short calls travel several to a message (app/worker/packs.py).

Real worker processes, the session's PostgreSQL and Redis, the simulator over HTTP
answering at once (or in a few tens of milliseconds), so that the workers' refills pack.
Each test proves that packs really went out (the messages' own results and log
lines, the broker's unacknowledged messages), then checks the shared invariants
against the simulator's own log: every item ended once, one result each, every
billed call in the ledger.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select, text

from batchgen.config import get_settings
from batchgen.limits.backend import get_redis
from batchgen.registry import get_registry
from batchgen.store import db
from batchgen.store.schema import Item
from tests.helpers import (
    FAULT_ENV,
    FAULT_RUNNING_LEASE_S,
    models_file_with,
    sim_config,
    submit_items,
    wait_batches,
)
from tests.invariants import check_invariants, reset_simulator, wait_until

pytestmark = pytest.mark.integration

# No sweep during the run: an item of a pack that waits or is handed back reaches a
# worker again only through the pack's own retry or hand-back.
NO_SWEEP = {"BATCHGEN_SWEEP_INTERVAL_S": "3600"}
# Full packs whatever the machine's load: a refill sizes its packs by this process's
# recent call times (a loaded machine's calls take longer, its packs would be smaller),
# and a pack that ran pack_max_s hands its rest back. Any call time under half a
# second fills a pack of 8, and no pack runs out of time.
FULL_PACKS = {"BATCHGEN_PACK_TARGET_S": "5", "BATCHGEN_PACK_MAX_S": "120"}
# A pack's items run one after another, each as a message of its own would
# (app/worker/packs.py), rather than as a group (app/worker/pack_calls.py).
ONE_AFTER_ANOTHER = {"BATCHGEN_PACK_CALLS_TOGETHER": "false"}
# What a quick provider's call takes on a loaded machine (the wait for a core
# included): more than the default pack_target_s (0.05 s) over two calls.
LOADED_CALL_MS = 30
PACK_RESULT = re.compile(r"succeeded in [0-9.e-]+s: '([^']*)'")


@pytest.fixture
def sim(simulator: Any, clean_db: dict[str, str]) -> Iterator[Any]:
    """The module's simulator answering at once, with an empty request log."""
    reset_simulator(simulator.base_url)
    sim_config(simulator.base_url, latency_base_ms=0, latency_per_token_ms=0)
    yield simulator
    sim_config(simulator.base_url, latency_base_ms=50, latency_per_token_ms=0.5)


def pack_sizes(log: str) -> list[int]:
    """How many items each message that ended well ran, from its result ('succeeded 7,
    expired 1', or an item's own outcome for a message of one); items it handed back
    are not counted: their own messages count them."""
    sizes = []
    for result in PACK_RESULT.findall(log):
        counts = re.findall(r"([a-z ]+?) (\d+)", result)
        ran = [int(n) for outcome, n in counts if outcome.strip() != "handed back"]
        sizes.append(sum(ran) if counts else 1)
    return sizes


def unacked_packs() -> list[list[int]]:
    """The item ids of every message a worker holds unacknowledged that carries a pack."""
    packs = []
    for raw in get_redis().hvals("unacked"):
        payload = json.loads(raw)[0]
        if payload.get("headers", {}).get("task") != "batchgen.generate":
            continue
        args, kwargs, _ = json.loads(base64.b64decode(payload["body"]))
        if kwargs.get("more"):
            packs.append([int(args[0]), *(int(i) for i, _ in kwargs["more"])])
    return packs


@pytest.mark.parametrize("max_items", [8, 1])
def test_short_calls_travel_in_packs_and_each_item_runs_once(sim, workers, max_items):
    """Short calls (30 ms, as a loaded machine's quick calls take): the refills pack
    them by count, up to BATCHGEN_PACK_SHORT_ITEMS items a message (64; none with
    BATCHGEN_PACK_MAX_ITEMS=1), and every item succeeds once with one billed call."""
    sim_config(sim.base_url, latency_base_ms=LOADED_CALL_MS)
    n = 300
    batch_id = submit_items(f"packs{max_items}", n)
    env = {"BATCHGEN_PACK_MAX_ITEMS": str(max_items), **FULL_PACKS}
    worker = workers(concurrency=4, env=env)
    wait_batches([batch_id], timeout_s=120)

    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": n}
    assert report.billed_calls == n and report.retried_items == 0
    # A message's log line follows its items' commit: the last may still be on its way.
    wait_until(
        lambda: sum(pack_sizes(worker.log_tail(1_000_000))) >= n,
        30,
        lambda: f"the messages' results to account for {n} items",
    )
    sizes = pack_sizes(worker.log_tail(1_000_000))
    assert sum(sizes) == n, "a message's result does not account for its items"
    if max_items == 1:
        assert max(sizes) == 1
    else:
        full = get_settings().packs.short_items
        assert max(sizes) == full, f"no full pack went out: {sorted(sizes)[-10:]}"
        assert len(sizes) < n / 2, f"{len(sizes)} messages for {n} items"


def partly_run_packs() -> list[tuple[list[int], list[int]]]:
    """The packs a worker holds unacknowledged of which some items have ended and some
    are still queued (untried): (the pack's ids, its queued ids)."""
    packs = unacked_packs()
    if not packs:
        return []
    with db.session_scope() as s:
        status = dict(
            s.execute(
                select(Item.id, Item.status).where(Item.id.in_([i for p in packs for i in p]))
            ).all()
        )
    found = []
    for pack in packs:
        queued = [i for i in pack if status.get(i) == "queued"]
        if queued and any(status.get(i) == "succeeded" for i in pack):
            found.append((pack, queued))
    return found


@pytest.mark.slow
def test_a_worker_killed_mid_pack_loses_nothing(sim, workers):
    """SIGKILL a worker while it holds a pack part of which has run: the item in its
    call is swept back when its running lease runs out, the pack's untried items when
    their queued leases do, and another worker runs them all. Every item succeeded
    once; the ledger matches the simulator's log."""
    # Calls of 100 ms in full packs (within the default pack_max_s, which the queued
    # lease follows): a pack takes most of a second, so the items it has not yet tried
    # at the look below are still untried at the kill, however loaded the machine.
    sim_config(sim.base_url, latency_base_ms=100)
    n = 160
    batch_id = submit_items("packkill", n)
    env = {**FAULT_ENV, "BATCHGEN_PACK_TARGET_S": FULL_PACKS["BATCHGEN_PACK_TARGET_S"]}
    env.update(ONE_AFTER_ANOTHER)
    victim = workers(concurrency=4, env=env, name="victim")
    held = wait_until(partly_run_packs, 60, "a pack partly run", poll_s=0.01)
    victim.kill()
    assert victim.process.poll() is not None
    # Untried at the kill: still queued once the victim is dead (between the look
    # above and the kill, its pack may have begun one more of them).
    with db.session_scope() as s:
        still_queued = set(
            s.scalars(
                select(Item.id).where(
                    Item.id.in_([i for _, queued in held for i in queued]),
                    Item.status == "queued",
                )
            )
        )
    held = [(pack, [i for i in queued if i in still_queued]) for pack, queued in held]
    assert any(queued for _, queued in held), "the kill left no pack item untried"
    workers(concurrency=4, env=FAULT_ENV, name="survivor")
    wait_batches([batch_id], timeout_s=120)

    report = check_invariants(
        sim.base_url, get_redis(), slot_grace_s=FAULT_RUNNING_LEASE_S, worker_killed=True
    )
    assert report.statuses == {"succeeded": n}
    untried = [i for _, queued in held for i in queued]
    with db.session_scope() as s:
        attempts = dict(s.execute(select(Item.id, Item.attempts).where(Item.id.in_(untried))).all())
    print(
        f"\npack kill: {len(held)} packs partly run at the kill, {len(untried)} of their "
        f"items untried; {report.retried_items} items retried, {report.waste_rows} waste rows"
    )
    assert set(attempts) == set(untried)
    # Untried at the kill: run once afterwards, by the survivor, on their first attempt.
    assert all(a == 1 for a in attempts.values()), attempts


@pytest.mark.slow
def test_a_pack_that_meets_the_budget_waits_with_its_rest(sim, workers, tmp_path):
    """A budget of a few calls a window: a pack's item that is denied goes back to the
    broker with the pack's untried items in one retry after the wait (with no sweep
    running, nothing else could bring them back); nobody loses an attempt, and every
    item succeeds once. Calls of 30 ms, as a loaded machine's quick calls take."""
    sim_config(sim.base_url, latency_base_ms=LOADED_CALL_MS)
    env = {
        "BATCHGEN_MODELS_FILE": str(
            models_file_with(tmp_path / "models.toml", tokens_per_min=3000)
        ),
        "BATCHGEN_BUDGET_WINDOW_S": "2",
        **FULL_PACKS,
        **NO_SWEEP,
    }
    n = 80
    batch_id = submit_items("packwait", n)
    worker = workers(concurrency=4, env=env)
    wait_batches([batch_id], timeout_s=180)

    log = worker.log_tail(1_000_000)
    waits = [
        int(m) for m in re.findall(r"pack of \d+ items: item \d+ waits [0-9.]+ s with (\d+)", log)
    ]
    assert waits, "no pack met the budget"
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": n}
    assert report.billed_calls == n
    with db.session_scope() as s:
        assert s.scalar(select(func.max(Item.attempts))) == 1  # waits use no attempt
    print(f"\npack waits: {len(waits)} packs waited, with {sum(waits)} untried items")


def test_a_pack_whose_calls_turn_slow_hands_its_rest_back(sim, workers):
    """Packs sized for quick calls; then every call takes 150 ms and a message may run
    only 0.25 s: after two items a pack hands its untried items back, one per message,
    to the other threads (with no sweep running, nothing else could). Every item
    succeeds once."""
    env = {"BATCHGEN_PACK_TARGET_S": "5", "BATCHGEN_PACK_MAX_S": "0.25", **NO_SWEEP}
    env.update(ONE_AFTER_ANOTHER)
    sim_config(sim.base_url, latency_base_ms=150)
    n = 60
    batch_id = submit_items("packslow", n)
    worker = workers(concurrency=4, env=env)
    wait_batches([batch_id], timeout_s=120)

    log = worker.log_tail(1_000_000)
    handed = [int(m) for m in re.findall(r"ran past 0.25 s: (\d+) items handed back", log)]
    assert handed, "no pack handed its rest back"
    report = check_invariants(sim.base_url, get_redis())
    assert report.statuses == {"succeeded": n}
    assert report.billed_calls == n and report.retried_items == 0
    print(f"\npack hand-backs: {len(handed)} packs handed back {sum(handed)} items")


def test_a_refill_publishes_packs_in_fair_order(sim):
    """A release for messages of 8 items: 20 released items go out as 8 + 8 + 4 in the
    order the fair query gave them, the window grown to 8 times the messages."""
    from batchgen.config import get_settings
    from batchgen.worker.dispatch import dispatch

    submit_items("packa", 10)
    submit_items("packb", 10)
    spec = get_registry()["sim-small"]
    queue = spec.queue
    redis_client = get_redis()
    redis_client.delete(queue)
    released = dispatch(get_registry(), get_settings(), pack_items=lambda model: 8)
    assert released == 20
    messages = []
    for raw in reversed(redis_client.lrange(queue, 0, -1)):  # LPUSHed: oldest last
        payload = json.loads(raw)
        args, kwargs, _ = json.loads(base64.b64decode(payload["body"]))
        messages.append([int(args[0]), *(int(i) for i, _ in kwargs.get("more") or [])])
        assert kwargs["model"] == "sim-small"
    redis_client.delete(queue)
    assert [len(m) for m in messages] == [8, 8, 4]
    with db.session_scope() as s:
        tenants = dict(s.execute(select(Item.id, Item.tenant_id)).all())
    order = [tenants[i] for m in messages for i in m]
    # Fair order: the two tenants alternate, so every pack carries both.
    assert all(len(set(order[k : k + 8])) == 2 for k in (0, 8, 16))


def _dispatched_with_one_running(tag: str, running: str) -> list[int]:
    """Four items dispatched (their messages dropped), ``running``: "one" (the last
    runs on attempt 1, the rest queued) or "all but one" (the last stays queued)."""
    from batchgen.config import get_settings
    from batchgen.worker.dispatch import dispatch

    submit_items(tag, 4)
    get_redis().delete(get_registry()["sim-small"].queue)
    assert dispatch(get_registry(), get_settings()) == 4
    get_redis().delete(get_registry()["sim-small"].queue)
    with db.session_scope() as s:
        ids = sorted(s.scalars(select(Item.id)))
        where = "id = :last" if running == "one" else "id <> :last"
        s.execute(
            text(f"UPDATE items SET status = 'running', attempts = 1 WHERE {where}"),
            {"last": ids[3]},
        )
    return ids


def _lease_left_s() -> dict[int, float]:
    with db.session_scope() as s:
        rows = s.execute(
            select(Item.id, func.extract("epoch", Item.lease_expires_at - func.now()))
        ).all()
    return {i: float(left) for i, left in rows}


@pytest.mark.parametrize("kind", ["hold", "renew"])
def test_leases_are_extended_only_for_items_in_the_state_and_attempt_named(sim, kind):
    """store.items.hold_queued: queued items of the named attempt get a lease of at
    least lease_s from now, never a shorter one. store.items.renew_leases (a
    heartbeat): items running on the named attempt get a lease of lease_s from now,
    shorter too. Either way another attempt's lease, or that of an item in the other
    state, is left alone."""
    from batchgen.store import items

    extend = items.hold_queued if kind == "hold" else items.renew_leases
    ids = _dispatched_with_one_running(kind, "one" if kind == "hold" else "all but one")
    before = _lease_left_s()
    with db.autocommit() as connection:
        extended = extend(connection, [(ids[2], 1), (ids[0], 1), (ids[1], 2), (ids[3], 1)], 3600)
    after = _lease_left_s()
    assert extended == 2  # ids[0] and ids[2]: in the state named, for attempt 1
    assert after[ids[0]] > 3500 and after[ids[2]] > 3500
    assert after[ids[1]] == pytest.approx(before[ids[1]], abs=5)  # another attempt's
    assert after[ids[3]] == pytest.approx(before[ids[3]], abs=5)  # in the other state
    with db.autocommit() as connection:
        assert extend(connection, [(ids[0], 1)], 10) == 1
    if kind == "hold":  # never shortened
        assert _lease_left_s()[ids[0]] > 3500
    else:  # a renewal sets the lease
        assert _lease_left_s()[ids[0]] < 100


def test_a_packs_rest_handed_back_goes_out_in_packs_a_failed_over_item_alone(sim):
    """A group's rounds not begun go back in packs of the size given (a refill's now),
    with their queued leases held; an item failed over to another deployment (its
    ticket says which to avoid) travels alone."""
    from batchgen.config import get_settings
    from batchgen.worker.dispatch import dispatch
    from batchgen.worker.messages import _hand_back
    from batchgen.worker.packs import PackItem, PackOutcome

    submit_items("handback", 5)
    queue = get_registry()["sim-small"].queue
    redis_client = get_redis()
    redis_client.delete(queue)
    assert dispatch(get_registry(), get_settings()) == 5
    redis_client.delete(queue)
    with db.session_scope() as s:
        ids = sorted(s.scalars(select(Item.id)))
    rest = [PackItem(i, {"attempt": 1}) for i in ids[:4]]
    rest.insert(2, PackItem(ids[4], {"attempt": 1, "avoid": ["a"]}))
    outcome = PackOutcome([], [], None, rest)
    _hand_back(outcome, "sim-small", 6, ids[0], get_settings(), 2, 3600.0)
    messages = []
    for raw in reversed(redis_client.lrange(queue, 0, -1)):  # LPUSHed: oldest last
        args, kwargs, _ = json.loads(base64.b64decode(json.loads(raw)["body"]))
        messages.append([int(args[0]), *(int(i) for i, _ in kwargs.get("more") or [])])
    redis_client.delete(queue)
    assert messages == [ids[:2], [ids[4]], ids[2:4]]
    with db.session_scope() as s:
        left = s.scalar(select(func.min(func.extract("epoch", Item.lease_expires_at - func.now()))))
    assert float(left) > 3500  # every item's queued lease held
