"""An API key's own requests-per-minute limit, over Redis (one script call a request,
only for keys that have a limit): a bucket of a minute's requests refilled steadily
(GCRA), on Redis's clock, so it holds across every API process and host."""

from __future__ import annotations

import redis

from batchgen.domain.keys import gcra_interval_ms
from batchgen.limits import redis_keys as keys
from batchgen.limits.backend import script

MINUTE_MS = 60_000


def take(
    client: redis.Redis, key_id: int, requests_per_min: int, now_s: float | None = None
) -> float:
    """Count one request of the key; 0 when it may go, else the seconds until one may
    (nothing is counted then)."""
    wait_ms = script(client, "key_rate")(
        keys=[keys.key_rate(key_id)],
        args=[gcra_interval_ms(requests_per_min), MINUTE_MS, "" if now_s is None else now_s],
    )
    return int(wait_ms) / 1000.0
