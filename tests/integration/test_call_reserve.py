"""The calls' reserve of a model's slots (issue 28, item 2: a call behind a bulk
backlog starts as on an idle model): the gate's script against the pure rule, batch
work kept off the reserve while calls are recent and given it when they stop, a
model of several deployments, and a call behind a full backlog end to end."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from batchgen.config import Settings
from batchgen.domain.scheduling.call_reserve import batch_may_take
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import get_redis
from batchgen.limits.budget import Budget, Grant
from batchgen.limits.gate import Gate, Pass, Wait
from tests.helpers import chat_line, make_tenant, sim_config
from tests.integration.test_budget import spec
from tests.integration.test_pools import pool_spec
from tests.invariants import wait_until

pytestmark = pytest.mark.integration


class _Ticket:
    """What the gate reads of an item: a sync call's (``urgent``) or batch work's."""

    prompt_tokens_est, max_tokens, tenant_tokens_per_min = 10, 10, None

    def __init__(self, item_id: int, urgent: bool = False, tenant_id: int = 1) -> None:
        self.item_id, self.attempt, self.urgent = item_id, 1, urgent
        self.tenant_id, self.tenant_weight = tenant_id, 1


def _slot_states() -> list[tuple[int, int, int, int, int, bool]]:
    """Every small state of a model's slots: (limit, batch work holding, calls holding,
    calls waiting, the reserve, calls recent)."""
    return [
        (limit, bulk, calls, waiting, reserved, recent)
        for limit in range(1, 4)
        for bulk in range(limit + 1)
        for calls in range(limit - bulk + 1)
        for waiting, reserved, recent in itertools.product(range(3), range(4), (False, True))
    ]


def test_the_script_withholds_what_the_rule_says(clean_db):
    """Every small state of a model's slots (batch work and calls holding, calls
    waiting, the recent-calls mark, the reserve): the gate's script lets batch work
    take a slot exactly when app/domain/scheduling/call_reserve.py says it may."""
    redis = get_redis()
    lease_end = time.time() + 60
    wrong = []
    for limit, bulk, calls, waiting, reserved, recent in _slot_states():
        s = spec(tpm=10**6, rpm=10**5, key="rule", slots=limit)
        setup = redis.pipeline()
        setup.flushdb()
        for n in range(bulk + calls):
            setup.zadd(keys.slots(s.name), {f"h{n}:1": lease_end})
            setup.hset(keys.slot_tenants(s.name), f"h{n}:1", "2:1:call" if n >= bulk else "2:1")
        for n in range(waiting):
            setup.zadd(keys.slot_callers(s.name), {f"w{n}:1": lease_end})
        if recent:
            setup.set(keys.calls_seen(s.name), "1", px=60_000)
        setup.execute()
        budget = Budget(redis, Settings(call_reserved_slots=reserved))
        grant = budget.enter(s, "batch:1", 0, 10, slot_limit=limit, slot_lease_s=30)
        rule = batch_may_take(
            limit=limit,
            held=bulk + calls,
            reserved=reserved,
            calls_recent=recent,
            calls_holding=calls,
            calls_waiting=waiting,
        )
        if grant.granted != rule:
            wrong.append((limit, bulk, calls, waiting, reserved, recent, grant.granted))
    assert not wrong, wrong[:10]


def test_batch_work_keeps_off_the_reserve_while_calls_are_recent(clean_db):
    """Four slots, a reserve of one, calls recent for 1 s: before any call batch work
    takes all four; once a call was seen, it takes three and the call finds the fourth
    free at once, while a call holds it batch work may take the rest; once the calls
    stop (their mark lapses), batch work gets the fourth again."""
    redis = get_redis()
    gate = Gate(redis, Settings(slot_wait_s=0.0, call_reserved_slots=1, call_reserve_recent_s=1.0))
    s = spec(tpm=10**6, rpm=10**5, key="reserve", slots=4)

    lent = [gate.enter(s, _Ticket(n)) for n in range(1, 5)]
    assert all(isinstance(p, Pass) for p in lent)  # nobody calls: every slot is lent
    for p in lent:
        gate.settle(s, p, 1, 10)  # type: ignore[arg-type]

    first_call = gate.enter(s, _Ticket(100, urgent=True))
    assert isinstance(first_call, Pass)
    gate.settle(s, first_call, 1, 10)
    bulk = [gate.enter(s, _Ticket(n)) for n in range(11, 15)]
    assert [isinstance(p, Pass) for p in bulk] == [True, True, True, False]
    assert bulk[3].kind.value == "slot"  # type: ignore[union-attr]

    call = gate.enter(s, _Ticket(101, urgent=True))
    assert isinstance(call, Pass)  # at once: the reserve was free
    assert isinstance(gate.enter(s, _Ticket(14)), Wait)  # every slot held
    gate.settle(s, bulk[0], 1, 10)  # type: ignore[arg-type]
    late = gate.enter(s, _Ticket(14))
    assert isinstance(late, Pass)  # the call fills the reserve: the rest is batch work's
    gate.settle(s, call, 1, 10)
    assert isinstance(gate.enter(s, _Ticket(15)), Wait)  # the reserve is kept again

    wait_until(lambda: not redis.exists(keys.calls_seen(s.name)), 10, "the calls' mark lapses")
    assert isinstance(gate.enter(s, _Ticket(15)), Pass)  # lent again


def test_the_reserve_is_of_the_models_slots_across_its_deployments(clean_db):
    """A model of two deployments of two slots each (four in all), a reserve of one:
    with calls recent, batch work fills three slots over both deployments; the call
    takes the one left, on whichever deployment has it, and nothing is overshot."""
    redis = get_redis()
    s = pool_spec(("a", 10**6, 10**4, 2), ("b", 10**6, 10**4, 2))
    budget = Budget(redis, Settings(call_reserved_slots=1))
    share = ("1:1", 0, "", 0.0)
    redis.set(keys.calls_seen(s.name), "1", px=60_000)  # a call was seen
    grants = [
        budget.enter(s, f"b{n}:1", 0, 10, slot_limit=4, slot_lease_s=30, share=share)
        for n in range(4)
    ]
    assert [g.granted for g in grants] == [True, True, True, False]
    assert grants[3].reason == "slot"
    taken = [g.deployment for g in grants if g.granted]
    call = budget.enter(s, "c:1", 0, 10, slot_limit=4, slot_lease_s=30, urgent=True, share=share)
    assert call.granted and call.deployment in "ab"
    assert sorted([*taken, call.deployment]) == ["a", "a", "b", "b"]
    assert redis.zcard(keys.slots(s.name)) == 4
    assert [redis.zcard(keys.slots(f"pool@{n}")) for n in "ab"] == [2, 2]


@pytest.mark.slow
def test_a_call_behind_a_full_backlog_passes_the_gate_at_its_first_try(
    clean_db, simulator, workers, monkeypatch
):
    """A bulk backlog on an 8-slot model whose calls take 1 s: before any call it holds
    all eight slots; after a first call, it holds seven (every one but the reserve),
    and the next call's first try at the gate is a pass (before the reserve, every slot
    was the backlog's and the call was denied until one of its calls ended)."""
    from batchgen import python_api
    from batchgen.domain.formats.admission import CHAT_COMPLETIONS
    from batchgen.worker.call_answers import wait_call
    from batchgen.worker.call_runner import call_runtime

    model, slots = "sim-large", 8
    redis = get_redis()
    make_tenant("bulk")
    make_tenant("caller")
    worker = workers(concurrency=slots + 2, wait=False)
    sim_config(simulator.base_url, latency_base_ms=1000)
    held = lambda: redis.zcard(keys.slots(model))  # noqa: E731
    gate, tries = call_runtime()[0], []
    enter = gate.budget.enter

    def first_try_counted(*args: Any, **kwargs: Any) -> Grant:
        # The call's first try waits until the backlog holds every slot it may take and
        # the first call's slot is free again (its caller hears of its end just before
        # the slot is given back).
        if not tries:
            wait_until(lambda: held() == slots - 1, 30, "the backlog holds its slots")
        before = held()
        grant = enter(*args, **kwargs)
        tries.append((before, grant))
        return grant

    try:
        worker.wait_ready()
        lines = [chat_line(f"bulk-{i}", model=model, max_tokens=5) for i in range(200)]
        backlog = python_api.submit_batch(lines, tenant="bulk", priority="bulk")
        wait_until(lambda: held() == slots, 60, "the backlog holds every slot (no calls yet)")

        line = chat_line("call", model=model, max_tokens=5)
        start = {"tenant": "caller", "endpoint": CHAT_COMPLETIONS, "deadline_s": 30}
        assert wait_call(python_api.start_call(line, **start)).response is not None  # marks

        monkeypatch.setattr(gate.budget, "enter", first_try_counted)
        assert wait_call(python_api.start_call(line, **start)).response is not None
    finally:
        sim_config(simulator.base_url, latency_base_ms=50)
    python_api.cancel_batch(backlog["id"], tenant="bulk")
    held_before, grant = tries[0]
    assert grant.granted, tries  # its first try
    assert held_before == slots - 1  # the backlog held every slot but the reserve
