"""Reference copy of limits/lua/gate_rebuild.lua: what to rebuild of the gate's lost state.

What to rebuild of the gate's Redis state after Redis lost it (pure).

Redis holds the gate's budgets and slots; PostgreSQL holds what was running and
what was billed. When the gate's marker is missing (a new Redis, a failover that
lost writes, a restart empty, ``FLUSHALL``), the database's recent evidence says
whether there was state to lose:

- no item running and no call billed within the last budget window: a first
  start (or a quiet one): nothing to rebuild;
- otherwise, conservatively: each budget (``budget_key``) of a deployment with a
  call billed in the window or an item running now restarts as spent for one
  window (no provider limit can be exceeded by the calls in flight or just made),
  and each running item takes its concurrency slots again (its ``item:attempt``
  as holder, its running lease as the slot's lease).

The Redis edge is :mod:`batchgen.limits.gate_state`; the evidence is read by
:mod:`batchgen.store.gate_evidence`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from batchgen.registry import Deployment, Registry


@dataclass(frozen=True)
class RunningItem:
    """An item running now: its current attempt, model, deployment (None: not known
    yet) and the seconds left of its running lease."""

    item_id: int
    attempt: int
    model: str
    deployment: str | None
    lease_left_s: float


@dataclass(frozen=True)
class Evidence:
    """Recent use the database shows: items running now, and the ``(model,
    deployment)`` of calls billed online within the last budget window."""

    running: Sequence[RunningItem] = ()
    billed: Sequence[tuple[str, str | None]] = ()

    @property
    def any(self) -> bool:
        return bool(self.running) or bool(self.billed)


@dataclass(frozen=True)
class SpentBudget:
    """A budget restarted as spent: its whole window's tokens and requests."""

    budget_key: str
    tokens: int
    requests: int


@dataclass(frozen=True)
class HeldSlot:
    """A concurrency slot to take again: in the set of ``slot_key``."""

    slot_key: str
    holder: str
    lease_s: float


@dataclass(frozen=True)
class RebuildPlan:
    budgets: tuple[SpentBudget, ...] = ()
    slots: tuple[HeldSlot, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.budgets and not self.slots


def _deployments(registry: Registry, model: str, deployment: str | None) -> list[Deployment]:
    spec = registry.get(model)
    if spec is None:
        return []
    named = [d for d in spec.deployments if d.name == deployment]
    # Unknown (an old row, or not sent yet): every deployment of the model, to be safe.
    return list(named or spec.deployments)


def rebuild_plan(evidence: Evidence, registry: Registry) -> RebuildPlan:
    """What to restore, from the evidence (empty: a first start, nothing to do).

    A model the registry no longer has is skipped (its budget is nobody's now); a
    budget shared by several deployments is spent once, with the smallest limits
    any of them declares."""
    budgets: dict[str, SpentBudget] = {}
    used: Iterable[tuple[str, str | None]] = [
        *evidence.billed,
        *((r.model, r.deployment) for r in evidence.running),
    ]
    for model, deployment in used:
        for d in _deployments(registry, model, deployment):
            key = d.budget_key
            spent = SpentBudget(key, d.tokens_per_min, d.requests_per_min)
            seen = budgets.get(key)
            if seen is not None:
                spent = SpentBudget(
                    key, min(seen.tokens, spent.tokens), min(seen.requests, spent.requests)
                )
            budgets[key] = spent
    slots: dict[tuple[str, str], HeldSlot] = {}
    for r in evidence.running:
        spec = registry.get(r.model)
        if spec is None or r.lease_left_s <= 0:
            continue
        holder = f"{r.item_id}:{r.attempt}"
        names = [spec.name]
        if r.deployment is not None:
            names += [d.slot_key for d in spec.deployments if d.name == r.deployment]
        for name in dict.fromkeys(names):
            slots[(name, holder)] = HeldSlot(name, holder, r.lease_left_s)
    return RebuildPlan(
        tuple(sorted(budgets.values(), key=lambda b: b.budget_key)),
        tuple(sorted(slots.values(), key=lambda s: (s.slot_key, s.holder))),
    )


def ended_slots(plan: RebuildPlan, again: Evidence) -> tuple[HeldSlot, ...]:
    """The plan's slots whose holder (``item:attempt``) no longer runs in ``again``,
    the evidence read after the rebuild: to free."""
    running = {f"{r.item_id}:{r.attempt}" for r in again.running}
    return tuple(s for s in plan.slots if s.holder not in running)
