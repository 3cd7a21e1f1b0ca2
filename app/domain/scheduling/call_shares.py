"""Fair shares of a model's concurrency slots among the tenants making synchronous
calls, and the fail-fast rule for a tenant over its share (pure).

A synchronous call takes a slot the moment one frees (someone waits on it), so
without a share the tenant with the most callers polling takes nearly every
slot: 40 parallel calls of one tenant starved another's single call past its
deadline, and starved other tenants' batches (a waiting call claims the next free
slot before batch work). Each tenant's sync calls on a model may hold at most its
share of the model's ``max_concurrency``, computed here from what every tenant
asks for now (its sync calls and batch items holding a slot or waiting for one)
and its weight, the way batches share the dispatch window
(deficit round robin, :mod:`batchgen.domain.scheduling.round_robin`).

The share is weighted max-min (water-filling): slots go one at a time to the
tenant furthest below its weighted share, and never beyond what a tenant asks
for, so a tenant alone may use every slot and no slot stays idle while a tenant
that wants it is capped. A tenant with a call waiting always has a share of at
least one, so none waits forever behind more tenants than slots.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Demand:
    """What one tenant asks of a model's slots now."""

    weight: int  # the tenant's weight (>= 1), as for batches
    running: int  # its work holding a slot (sync calls and batch items)
    waiting: int  # its work waiting for one

    @property
    def wanted(self) -> int:
        return max(0, self.running) + max(0, self.waiting)


def fair_shares(limit: int, demands: Mapping[K, Demand]) -> dict[K, int]:
    """Each tenant's share of ``limit`` slots: weighted max-min over what it asks for.

    Every tenant asking for anything has one slot first (with more such tenants than
    slots, each still has one: the slots themselves then bound them). The rest go
    one at a time to the tenant whose next slot has the lowest rank, (share + 1) /
    weight (ties: the order of ``demands``), skipping tenants that have what they
    ask for. The shares add up to ``min(limit, total asked)`` (or the number of
    tenants asking, if that is more).
    """
    shares: dict[K, int] = {key: 1 if d.wanted > 0 else 0 for key, d in demands.items()}
    open_keys = [key for key, d in demands.items() if d.wanted > 0]
    for _ in range(max(0, limit - len(open_keys))):
        open_keys = [key for key in open_keys if shares[key] < demands[key].wanted]
        if not open_keys:
            break
        key = min(open_keys, key=lambda k: (shares[k] + 1) / max(1, demands[k].weight))
        shares[key] += 1
    return shares


def share_of(limit: int, demands: Mapping[K, Demand], tenant: K) -> int:
    """The share of one tenant (one, at least, for a tenant that asks for nothing yet:
    its call is about to)."""
    return max(1, fair_shares(limit, demands).get(tenant, 0))


@dataclass(frozen=True)
class Refusal:
    """A call refused before it is stored: ``status`` 429 (its own tenant's calls fill
    its share past its deadline) or 503 (the model's calls do); retry after
    ``retry_after_s``."""

    status: int
    retry_after_s: int
    wait_s: float


def refuse_call(
    *,
    open_calls: int,
    share: int,
    call_s: float,
    model_wait_s: float,
    deadline_s: float,
) -> Refusal | None:
    """The fail-fast rule for a new call, before it is stored.

    ``open_calls`` of its own tenant are open on the model (waiting or running) and
    the tenant may hold ``share`` slots, each for about ``call_s``: the new call
    starts after ``floor(open_calls / share)`` rounds of the tenant's own calls. If
    that alone passes ``deadline_s``, the tenant is over its share: 429. If the
    model's own wait (``model_wait_s``: its backlog of tokens, a cooldown) passes it,
    503. Otherwise None: the call is taken. ``call_s`` 0 (no call timed yet) waits
    for no rounds."""
    own_wait_s = math.floor(max(0, open_calls) / max(1, share)) * max(0.0, call_s)
    if model_wait_s >= deadline_s and model_wait_s >= own_wait_s:
        return Refusal(503, max(1, math.ceil(model_wait_s)), model_wait_s)
    if own_wait_s + call_s >= deadline_s and own_wait_s > 0:
        return Refusal(429, max(1, math.ceil(own_wait_s)), own_wait_s)
    return None
