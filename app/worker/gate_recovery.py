"""Rebuilding the gate's Redis state after Redis lost it (issue: a primary failover,
a restart empty, ``FLUSHALL``).

The sweep checks the gate's marker on every tick, and each process on its first use
of the gate (and then every ``BATCHGEN_GATE_STATE_CHECK_S``). Missing, one process
(the rebuild lock) reads the database's evidence of recent use
(:mod:`batchgen.store.gate_evidence`): none is a first start, and only the marker is
set; any is lost state, rebuilt conservatively (:mod:`batchgen.domain.scheduling.gate_rebuild`:
the budgets used restart as spent for one window, the running items take their slots
again). The other processes wait for the marker, at most the lock's time.
"""

from __future__ import annotations

import logging
import time

import redis
from sqlalchemy.exc import SQLAlchemyError

from batchgen.config import Settings
from batchgen.domain.scheduling.gate_rebuild import RebuildPlan, ended_slots, rebuild_plan
from batchgen.limits import gate_state
from batchgen.limits import redis_keys as keys
from batchgen.limits.gate import Gate
from batchgen.registry import Registry, get_registry
from batchgen.store import gate_evidence
from batchgen.store.db import session_scope

log = logging.getLogger(__name__)

LOCK_TTL_S = 10.0
POLL_S = 0.05


def ensure_gate_state(client: redis.Redis, registry: Registry, settings: Settings) -> str:
    """Make the gate's state known good. Returns what it found: ``known`` (the marker
    was set), ``first`` (nothing to rebuild), ``rebuilt``, or ``waited`` (another
    process rebuilt it, or its lock lapsed meanwhile)."""
    if not settings.budget.enabled or gate_state.is_known_good(client):
        return "known"
    token = gate_state.take_lock(client, LOCK_TTL_S)
    if token is None:
        deadline = time.monotonic() + LOCK_TTL_S
        while time.monotonic() < deadline and not gate_state.is_known_good(client):
            time.sleep(POLL_S)
        return "waited"
    with session_scope() as session:
        evidence = gate_evidence.read(session, settings.budget.window_s + settings.budget.guard_s)
    plan = rebuild_plan(evidence, registry)
    done = gate_state.rebuild(
        client, plan, token, settings.budget.window_s, settings.budget.guard_s
    )
    if not done:
        return "waited"
    if plan.empty:
        return "first"
    _release_ended(client, plan, settings)
    log.warning(
        "the gate's state in Redis was lost: rebuilt %d budget(s) as spent for one window "
        "and %d slot(s) of running items",
        len(plan.budgets),
        len(plan.slots),
    )
    return "rebuilt"


def _release_ended(client: redis.Redis, plan: RebuildPlan, settings: Settings) -> None:
    """Free the rebuilt slots of items that ended meanwhile. An item records its end
    before it frees its slot; one that did both between the evidence's read and the
    rebuild freed nothing (its slot was not there yet) and would leave the slot held
    until its lease ran out. Read again after the rebuild, such an item is seen ended;
    one that ends later frees its own slot."""
    if not plan.slots:
        return
    with session_scope() as session:
        again = gate_evidence.read(session, settings.budget.window_s + settings.budget.guard_s)
    ended = ended_slots(plan, again)
    if not ended:
        return
    pipe = client.pipeline(transaction=False)
    for slot in ended:
        pipe.zrem(keys.slots(slot.slot_key), slot.holder)
    pipe.execute()


def ensure_quietly(client: redis.Redis, registry: Registry, settings: Settings) -> None:
    """:func:`ensure_gate_state`, Redis or PostgreSQL being unreachable left for the next
    try (the sweep's next tick, the gate's next check; the rebuild lock lapses)."""
    try:
        ensure_gate_state(client, registry, settings)
    except (redis.RedisError, SQLAlchemyError) as error:
        log.warning("gate state not checked: %s unreachable", type(error).__name__)


def checked_gate(client: redis.Redis, settings: Settings) -> Gate:
    """A gate that makes its state known good on its first entry and every
    ``gate_state_check_s`` after (:func:`ensure_quietly`)."""
    return Gate(client, settings, lambda: ensure_quietly(client, get_registry(), settings))
