"""What the tenants ask of a model's slots, over Redis, for the shares of sync calls.

Each try of a waiting sync call renews its entry (``tenant:weight:item``, lapsing
after ``DEMAND_TTL_S``) and reads every tenant's work waiting and holding a slot
(one script, ``lua/call_demand.lua``); batch work denied a slot adds its entry in
the gate's own script, and every slot holder is recorded with its tenant.
:func:`batchgen.domain.scheduling.call_shares.share_of` turns that into the tenant's share,
and the gate's entry script holds a sync call's tenant to it atomically with
taking the slot (``lua/budget_reserve.lua``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import redis

from batchgen.domain.scheduling.call_shares import Demand
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import script

# How long a waiting call's entry counts without a new try. A call denied a slot for
# ``slot_wait_s`` sleeps its short countdown before trying again (SLOT_RETRY_S and
# jitter): its entry outlasts that, so its tenant's share does not vanish meanwhile.
DEMAND_TTL_S = 2.0


def tenant_key(tenant_id: int, weight: int) -> str:
    """How a tenant is named in the demand and holder entries."""
    return f"{tenant_id}:{max(1, weight)}"


def demand_entry(tenant_id: int, weight: int, item_id: int) -> str:
    """A waiting call's entry in the model's demand."""
    return f"{tenant_key(tenant_id, weight)}:{item_id}"


def parse(waiting: list[bytes | str], running: list[bytes | str]) -> dict[int, Demand]:
    """The script's reply as each tenant's demand (malformed entries are left out)."""
    found: dict[int, list[int]] = {}  # tenant -> [weight, running, waiting]

    def add(entry: bytes | str, slot: int) -> None:
        text = entry.decode() if isinstance(entry, bytes) else str(entry)
        tenant, _, rest = text.partition(":")
        weight = rest.partition(":")[0]
        if not (tenant.isdigit() and weight.isdigit()):
            return
        counts = found.setdefault(int(tenant), [max(1, int(weight)), 0, 0])
        counts[slot] += 1

    for entry in running:
        add(entry, 1)
    for entry in waiting:
        add(entry, 2)
    return {t: Demand(weight=w, running=r, waiting=q) for t, (w, r, q) in found.items()}


class CallDemand:
    """The demand of one model's sync calls (renewed by each try, read by the gate)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def read(self, model: str, entry: str = "", ttl_s: float = DEMAND_TTL_S) -> dict[int, Demand]:
        """Every tenant's demand on ``model``, after adding or renewing ``entry`` (a
        waiting call's, :func:`demand_entry`; empty: only read)."""
        waiting, running = script(self.client, "call_demand")(
            keys=[keys.call_demand(model), keys.slot_tenants(model), keys.slots(model)],
            args=[entry, ttl_s],
        )
        return parse(list(waiting), list(running))

    def read_with_ttls(
        self, model: str, ttl_keys: Sequence[str]
    ) -> tuple[dict[int, Demand] | None, list[int | None]]:
        """Every tenant's demand on ``model`` (only read; None when the script failed)
        and the PTTL of each of ``ttl_keys`` (ms; None: no expiry or no key), in one
        round trip (a pipeline: the script and the reads, each atomic on its own). A
        Redis that forgot the script (a flush) has it loaded and the pipeline sent
        again; a lost connection is raised, as by :meth:`read`."""
        runner = script(self.client, "call_demand")
        keys_ = [keys.call_demand(model), keys.slot_tenants(model), keys.slots(model)]
        for last_try in (False, True):
            pipe = self.client.pipeline(transaction=False)
            pipe.evalsha(runner.sha, len(keys_), *keys_, "", DEMAND_TTL_S)
            for key in ttl_keys:
                pipe.pttl(key)
            try:
                (waiting, running), *ttls = pipe.execute()
            except redis.exceptions.NoScriptError:
                if last_try:
                    raise
                self.client.script_load(runner.script)
                continue
            except redis.exceptions.ResponseError:  # the script's own error: no demand
                return None, self._ttls(ttl_keys)
            return parse(list(waiting), list(running)), [_ttl(t) for t in ttls]
        raise AssertionError("unreachable")

    def _ttls(self, ttl_keys: Sequence[str]) -> list[int | None]:
        pipe = self.client.pipeline(transaction=False)
        for key in ttl_keys:
            pipe.pttl(key)
        return [_ttl(t) for t in pipe.execute()]

    def forget(self, model: str, entry: str) -> None:
        """The call no longer waits (it ended, or gave up): best effort, it lapses anyway."""
        with contextlib.suppress(redis.RedisError):
            self.client.zrem(keys.call_demand(model), entry)


def _ttl(reply: object) -> int | None:
    """A PTTL reply in ms; None for no key (-2) or no expiry (-1)."""
    return reply if isinstance(reply, int) and reply >= 0 else None
