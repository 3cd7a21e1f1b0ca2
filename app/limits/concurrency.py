"""Global per-model concurrency caps: a Redis semaphore with leases.

A slot is a member of a sorted set scored by its lease expiry; a worker that
dies holding one loses it when the lease runs out, with no cleanup needed.
"""

from __future__ import annotations

import redis

from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import script


class Slots:
    def __init__(self, client: redis.Redis):
        self.client = client

    def acquire(self, model: str, holder: str, limit: int, lease_s: float) -> bool:
        """Take one of ``limit`` slots for ``lease_s`` seconds (idempotent per holder)."""
        return bool(
            script(self.client, "slot_acquire")(
                keys=[keys.slots(model)], args=[holder, limit, lease_s]
            )
        )

    def release(self, model: str, holder: str, own: list[str] | None = None) -> None:
        """Free ``holder``'s slot in the model's set and in those of ``own`` (its
        deployments' slot keys, :attr:`batchgen.registry.Deployment.slot_key`)."""
        names = dict.fromkeys([model, *(own or [])])
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.zrem(keys.slots(name), holder)
        pipe.hdel(keys.slot_tenants(model), holder)
        pipe.execute()

    def held(self, model: str) -> int:
        """Slots currently held (leases not yet expired, on Redis's clock like the scores)."""
        return int(script(self.client, "slot_count")(keys=[keys.slots(model)]))
