"""Every Redis key this project writes, in one place.

On Redis Cluster a script (and a transaction) may only touch keys of one hash slot,
which a key's hash tag (its first ``{...}``) decides. The gate's scripts touch, in one
step, a tenant's budget, every deployment budget of a model, the model's slots, its
callers and its counters; tenants' budgets span every model and deployments of
several models may share a ``budget_key``, so no finer tag keeps all a script's keys
together: every key of the gate carries the one tag :data:`GATE_TAG` (one slot, one
primary; its load is a few script calls per provider call). A dollar budget's keys
share their tenant's tag; every other key is used alone and has no tag, so they
spread over the cluster. ``tests/unit/test_redis_slots.py`` checks each script's keys.

Gate keys were ``bg:budget:{<key>}:...`` before they took the tag: an upgrade finds
the old keys unused (they expire or are left behind) and starts as after a Redis that
lost its data (docs/operations.md, High availability).
"""

from __future__ import annotations

PREFIX = "bg:"
GATE_TAG = "{gate}"
GATE = f"{PREFIX}{GATE_TAG}:"


def budget_log(budget_key: str) -> str:
    return f"{GATE}budget:{budget_key}:log"


def budget_amounts(budget_key: str) -> str:
    return f"{GATE}budget:{budget_key}:amounts"


def budget_meta(budget_key: str) -> str:
    """Hash: reservation id -> "<prompt part> <prompt estimate>" (the part of its
    tokens the learned ratio scaled, and our own count of it), kept as long as the log."""
    return f"{GATE}budget:{budget_key}:meta"


def budget_bucket(budget_key: str) -> str:
    """Hash of a bucket-shaped budget: levels ``t`` (tokens) and ``r`` (requests) at
    time ``ts``, and the header the ratio's next sample starts from (``og``, ``oR``)."""
    return f"{GATE}budget:{budget_key}:bucket"


def budget_ratio(budget_key: str) -> str:
    """Hash: model -> learned ratio of the provider's prompt count to ours, and
    ``<model>:n`` -> samples learned from."""
    return f"{GATE}budget:{budget_key}:ratio"


def budget_shape(budget_key: str) -> str:
    """Hash of a budget whose registry entry sets no ``limit_shape``: the shape learned
    from the provider's reset headers (``shape``: ``window`` or ``bucket``; absent: a
    bucket) and ``n``, the headers in a row that said otherwise
    (:func:`batchgen.domain.scheduling.rate_limits.next_shape`)."""
    return f"{GATE}budget:{budget_key}:shape"


def cooldown(budget_key: str) -> str:
    return f"{GATE}budget:{budget_key}:cooldown"


def breaker(budget_key: str) -> str:
    """Hash: a deployment's circuit breaker (``n`` failures in the window that started
    at ``since``, ``trips`` in a row without an answer); open = its cooldown key set."""
    return f"{GATE}budget:{budget_key}:breaker"


def budget_waiters(budget_key: str) -> str:
    """Zset of callers denied by the budget, scored by their first denial (the line)."""
    return f"{GATE}budget:{budget_key}:waiters"


def budget_waiter_tokens(budget_key: str) -> str:
    """Hash: waiter -> tokens it asked for (what its claim holds)."""
    return f"{GATE}budget:{budget_key}:waiter-tokens"


def budget_waiters_seen(budget_key: str) -> str:
    """Zset of waiters scored by their last try (a waiter gone quiet loses its place)."""
    return f"{GATE}budget:{budget_key}:waiters-seen"


def tenant_log(tenant_id: int) -> str:
    return f"{GATE}tenant-budget:t{tenant_id}:log"


def tenant_amounts(tenant_id: int) -> str:
    return f"{GATE}tenant-budget:t{tenant_id}:amounts"


def slots(model: str) -> str:
    """Zset of a model's concurrency slots (holder -> lease end); ``model@deployment``
    for one deployment's own, beside the model's set of every deployment's holders."""
    return f"{GATE}slots:{model}"


def slot_callers(model: str) -> str:
    """Zset of synchronous calls waiting for one of the model's slots (scored by when
    their claim lapses): while one waits, no other work takes a slot that frees."""
    return f"{GATE}slots:{model}:callers"


def slot_tenants(model: str) -> str:
    """Hash: a slot holder -> ``tenant:weight`` (``:call`` after it for a synchronous
    call): whose work holds the model's slots, for the shares of sync calls."""
    return f"{GATE}slots:{model}:tenants"


def call_demand(model: str) -> str:
    """Zset of synchronous calls asking for one of the model's slots
    (``tenant:weight:item``, scored by when the entry lapses)."""
    return f"{GATE}slots:{model}:demand"


def calls_seen(model: str) -> str:
    """String with a TTL: a synchronous call entered the model's gate within
    ``call_reserve_recent_s``; while it lives, other work leaves the calls' reserve of
    slots free (``app/domain/scheduling/call_reserve.py``)."""
    return f"{GATE}slots:{model}:calls_seen"


def counters(model: str) -> str:
    """Hash of per-model event counters (denials, waits, cooldowns, 429s, errors)."""
    return f"{GATE}counters:{model}"


def rejections() -> str:
    """Hash of refused submissions, field ``<reason>:<tenant name>``."""
    return f"{PREFIX}rejections"


def running_item(item_id: int) -> str:
    """String: the attempt number a live worker runs the item on, renewed by its
    heartbeat (app/worker/heartbeat.py), expiring a running lease after its last renewal."""
    return f"{PREFIX}running:{item_id}"


def unsent_claim(item_id: int, claim_token: int) -> str:
    """String: a claim (``store.items.claim_sent``'s token) whose reply was lost, so no
    request left this worker for it (app/worker/execution.py); the sweep ledgers no
    waste for the item's attempt that claim marked sent."""
    return f"{PREFIX}unsent:{item_id}:{claim_token}"


def stream_usage(item_id: int, attempt: int) -> str:
    """String: the provider's usage of a streamed attempt, kept as its last chunk came
    (app/worker/execution.py), so the sweep ledgers it if the process dies unrecorded.
    Per attempt: another attempt's record never drops it."""
    return f"{PREFIX}usage:{item_id}:{attempt}"


def call_run_by_caller(item_id: int) -> str:
    """String: the attempt of a synchronous call that the process its caller waits in
    runs itself (app/worker/call_runner.py): if its caller is gone, so is its runner."""
    return f"{PREFIX}callrun:{item_id}"


def call_caller(item_id: int) -> str:
    """String: a synchronous call's caller still waits for it, renewed by the API
    process it waits in (app/python_api.py), expiring ``BATCHGEN_CALLER_LEASE_S`` after."""
    return f"{PREFIX}caller:{item_id}"


def workers() -> str:
    """Set of the names of workers that announced themselves (app/worker/presence.py);
    a name whose :func:`worker` key has expired is a worker gone."""
    return f"{PREFIX}workers"


def worker(name: str) -> str:
    """String: the queues a live worker consumes (comma-separated), renewed by it,
    expiring a few renewals after the last (app/worker/presence.py)."""
    return f"{PREFIX}worker:{name}"


CANCEL_CHANNEL = f"{PREFIX}cancel"
# Pub/sub: a model's slots freed ("<count> <origin> <model>": app/limits/slot_wakeups.py).
SLOTS_FREED_CHANNEL = f"{PREFIX}slots-freed"


def dashboard_session(token_hash: str) -> str:
    """String: the tenant id of a dashboard session (the cookie's token, hashed), with
    the session's expiry."""
    return f"{PREFIX}dashboard:session:{token_hash}"


def signin_attempts(kind: str, value_hash: str) -> str:
    """Counter of dashboard sign-ins from one client address or for one key
    (``kind``: ``addr`` or ``key``; the value hashed), expiring with its window."""
    return f"{PREFIX}dashboard:signin:{kind}:{value_hash}"


def key_rate(key_id: int) -> str:
    """String: the theoretical arrival time (ms) of an API key's next request, for its
    own requests-per-minute limit (limits.key_rate, GCRA), expiring when it is past."""
    return f"{PREFIX}key:{key_id}:rate"


def money(tenant_id: int, budget_id: int, period_key: str) -> str:
    """A dollar budget's period (batchgen.limits.money_budgets): one hash, in the tenant's slot
    so that a call reserves in its tenant's and its key's budgets in one script."""
    return f"{PREFIX}money:{{m{tenant_id}}}:{budget_id}:{period_key}"


def money_reservation(tenant_id: int, reservation_id: str) -> str:
    """The budgets' hashes a reservation is held in (space-separated): what settling it
    releases, once (batchgen.limits.money_budgets)."""
    return f"{PREFIX}money:{{m{tenant_id}}}:rsv:{reservation_id}"


def money_alert(tenant_id: int, budget_id: int, period_key: str, pct: int) -> str:
    """Set once when the budget's period reached ``pct`` per cent (its alert went)."""
    return f"{PREFIX}money:{{m{tenant_id}}}:{budget_id}:{period_key}:alert:{pct}"


def gate_state() -> str:
    """String: set once the gate's state is known good (a first start found nothing to
    rebuild, or what Redis lost was rebuilt: app/limits/gate_state.py). Missing: Redis
    lost the gate's keys (or never had them)."""
    return f"{GATE}state"


def gate_rebuild_lock() -> str:
    """String with a TTL: the one process rebuilding the gate's state (its token)."""
    return f"{GATE}state:rebuild"
