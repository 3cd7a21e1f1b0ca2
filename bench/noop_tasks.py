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

import logging
import os
from pathlib import Path
from typing import Any

from celery import Celery, signals
from celery.app.defaults import DEFAULTS
from kombu import Queue

from batchgen.worker.publish import celery_app as product

QUEUE = "bench.noop"
TASK = "bench.noop"

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
    task_queues=[Queue(QUEUE)],
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
