"""A Celery task that does nothing: the baseline of bench/overhead.py.

Its Celery application carries messages the way batchgen's does: it copies
every Celery setting of :data:`batchgen.worker.publish.celery_app` (that is,
``batchgen.celeryconfig``: broker, transport options, late acks, prefetch,
serializer, task events…) except the ones that say which tasks and queues
exist (``include``, queues, routes, the beat schedule). Whatever batchgen's
Celery settings become, the baseline follows them. Its worker runs the same
pool (``celery -A bench.noop_tasks worker -P threads``, see
:func:`bench.harness.start_celery_worker`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path
from typing import Any

from celery import Celery, signals
from celery.app.defaults import DEFAULTS
from kombu import Queue

from batchgen.worker.publish import celery_app as product

QUEUE = "bench.noop"
TASK = "bench.noop"
FLOOR_QUEUE = "bench.floor"  # the round-trip floor (below)
FLOOR_TASK = "bench.floor"

# Settings naming batchgen's tasks, queues and schedule: the baseline has its own.
NOT_COPIED = frozenset(
    {
        "include",
        "imports",
        "task_queues",
        "task_routes",
        "task_default_queue",
        "task_default_exchange",
        "task_default_routing_key",
        "beat_schedule",
        "beat_scheduler",
    }
)


def product_settings() -> dict[str, Any]:
    """batchgen's Celery settings (the ones it sets), but for tasks, queues and beat."""
    table = product.conf.table(with_defaults=False)
    return {k: v for k, v in table.items() if k in DEFAULTS and k not in NOT_COPIED}


app = Celery("bench_noop", set_as_current=False)
app.conf.update(product_settings())
app.conf.update(
    task_queues=[Queue(QUEUE), Queue(FLOOR_QUEUE)],
    task_default_queue=QUEUE,
    task_routes=None,
    beat_schedule={},
)


@app.task(name=TASK, ignore_result=True, shared=False)
def noop(item_id: int, model: str | None = None) -> None:
    """Nothing. Same arguments as batchgen's ``generate`` message (an id, a model)."""


@signals.setup_logging.connect
def _setup_logging(**_: Any) -> None:
    # Like batchgen's workers: the level of BATCHGEN_LOG_LEVEL, not Celery's --loglevel.
    logging.basicConfig(level=os.environ.get("BATCHGEN_LOG_LEVEL", "INFO").upper())


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    ready_file = os.environ.get("BATCHGEN_READY_FILE")
    if ready_file:
        Path(ready_file).touch()


# --- The round-trip floor ----------------------------------------------------------
#
# A task that makes the round trips batchgen's item makes, with nothing else
# (``steps="trips"``): a Redis script before the call (the gate's enter), a PostgreSQL
# statement (the claim), the provider call itself through batchgen's provider adapter
# (the same client, the same stream reader, the same simulator answer as the measured
# run's item of that index), a PostgreSQL statement (the record), a Redis script (the
# settle). Every statement and script is trivial: what the task costs above the no-op is
# the price of the round trips, what batchgen costs above it is its own work (state,
# budget, ledger, refill). ``steps="call"``: the provider call and the last script only.
# The last script counts the tasks that got through (FLOOR_DONE_KEY).

FLOOR_ROWS_ENV = "BENCH_FLOOR_ROWS"  # how many rows of bench.harness.chat_requests(…, "run")
FLOOR_DONE_KEY = "bench:floor:done"
FLOOR_STEPS = ("trips", "call")


@functools.cache
def _floor() -> tuple[Any, Any, Any, list[dict[str, Any]]]:
    from batchgen.limits.backend import get_redis
    from bench.harness import chat_requests

    redis_client = get_redis()
    enter = redis_client.register_script("return 1")
    settle = redis_client.register_script("return redis.call('INCR', KEYS[1])")
    rows = chat_requests(int(os.environ.get(FLOOR_ROWS_ENV, "1")), "bench", "run")
    return redis_client, enter, settle, [row["body"] for row in rows]


@app.task(name=FLOOR_TASK, ignore_result=True, shared=False)
def floor(item_id: int, model: str | None = None, steps: str = "trips") -> None:
    """Batchgen's round trips of one item, and nothing else (see above)."""
    from batchgen.config import get_settings
    from batchgen.providers import get_provider
    from batchgen.providers.base import ProviderRequest
    from batchgen.registry import get_registry
    from batchgen.store import db

    redis_client, enter, settle, bodies = _floor()
    spec = get_registry().get(model or "bench")
    if spec is None or steps not in FLOOR_STEPS:
        raise ValueError(f"floor: unknown model {model!r} or steps {steps!r}")
    trips = steps == "trips"
    if trips:
        enter(keys=["bench:floor"], args=[item_id], client=redis_client)
        with db.autocommit() as connection:  # the claim's round trip
            db.driver_rows(connection, "SELECT 1", {})
    get_provider(spec).complete(
        ProviderRequest(
            spec=spec,
            body=bodies[item_id % len(bodies)],
            timeout_s=60.0,
            item_id=item_id,
            cancel=threading.Event(),
            stream=get_settings().providers.stream_calls,
        )
    )
    if trips:
        with db.autocommit() as connection:  # the record's round trip
            db.driver_rows(connection, "SELECT 1", {})
    settle(keys=[FLOOR_DONE_KEY], client=redis_client)
