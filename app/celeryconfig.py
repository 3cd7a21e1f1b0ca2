"""Celery settings, read from the one settings object (batchgen.config) and the model registry.

Queues: one per model group (``llm.<group>``, from the registry) and
``batchgen.control`` for the dispatcher and the sweep. Messages carry ids
only; results live in PostgreSQL, so Celery keeps none.
"""

import math

from kombu import Exchange, Queue

from batchgen.config import get_settings
from batchgen.registry import get_registry
from batchgen.worker.beat import cron_schedule
from batchgen.worker.names import (
    CONTROL_QUEUE,
    DISPATCH_TASK,
    GENERATE_TASK,
    NIGHTLY_TASK,
    NOTIFY_QUEUE,
    NOTIFY_TASK,
    OFFLOAD_TASK,
    RETENTION_TASK,
    SWEEP_TASK,
)

_settings = get_settings()
_registry = get_registry()

AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")


def is_amqp(url: str) -> bool:
    """Whether ``url`` names a RabbitMQ (AMQP 0-9-1) broker; every other broker
    batchgen runs on is Redis."""
    return url.partition("://")[0].lower() in AMQP_SCHEMES


def broker_queue(name: str, url: str) -> Queue:
    """The queue ``name`` as the broker of ``url`` wants it. Redis: a plain queue (a
    list). RabbitMQ: a durable quorum queue behind a topic exchange of its own name,
    so that Celery's native delayed delivery can route countdowns back to it (it
    does not work through direct exchanges)."""
    if not is_amqp(url):
        return Queue(name)
    return Queue(
        name,
        Exchange(name, type="topic"),
        routing_key=name,
        queue_arguments={"x-queue-type": "quorum"},
    )


def countdown_for_broker(countdown_s: float, url: str) -> float:
    """The countdown to publish a retry with. Redis: as asked. RabbitMQ with quorum
    queues: rounded up to whole seconds (at least 1): native delayed delivery counts
    whole seconds and refuses (Celery 5.7 raises ValueError, the retry is lost) a
    delay under one second; rounding up also means the message is due when it arrives
    and is not held unacknowledged in the worker for the rest."""
    if not is_amqp(url) or countdown_s <= 0:
        return countdown_s
    return float(max(1, math.ceil(countdown_s)))


broker_url = _settings.broker_url
broker_connection_retry_on_startup = True
broker_transport_options: dict[str, object]
if is_amqp(broker_url):
    # RabbitMQ: a publish returns once the broker has taken the message (a refused or
    # lost one raises in the publisher, and its item waits for the sweep). Unacked
    # messages come back when their consumer's connection closes; there is no
    # visibility timeout.
    broker_transport_options = {"confirm_publish": True}
else:
    broker_transport_options = {
        # Unacked messages return after this; every countdown we use is far shorter.
        "visibility_timeout": _settings.broker.visibility_timeout_s,
    }

task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
task_ignore_result = True
result_backend = None

# At-least-once delivery; the tasks are idempotent against PostgreSQL.
task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1
worker_pool = "threads"  # provider calls are I/O-bound
worker_concurrency = _settings.worker.concurrency
worker_hijack_root_logger = False

# Flower and events: task names are readable, arguments are ids only. Workers send
# the task events; publishers send none (a "sent" event cannot be turned off per
# task, and the dispatch tick every second and the sweep would bury the items'
# tasks under PENDING entries). The dispatch and sweep tasks send no events at all.
worker_send_task_events = True
task_send_sent_event = False

task_queues = [
    broker_queue(q, broker_url) for q in [CONTROL_QUEUE, NOTIFY_QUEUE, *_registry.queues]
]
task_default_queue = CONTROL_QUEUE
if is_amqp(broker_url):
    # Quorum queues (replicated, and what RabbitMQ 4 recommends). Their countdown and
    # ETA messages wait in the broker (Celery's native delayed delivery: topic
    # exchanges, whole seconds, see countdown_for_broker) rather than unacknowledged in
    # a worker, and the prefetch is per consumer (quorum queues have no global QoS).
    task_default_queue_type = "quorum"
    task_default_exchange_type = "topic"
    worker_detect_quorum_queues = True
    broker_native_delayed_delivery_queue_type = "quorum"


def route_task(name, args, kwargs, options, task=None, **kw):  # type: ignore[no-untyped-def]
    """Each item goes to its model group's queue (one worker pool per group), the
    notification tick to its own queue (served by the model workers); every other
    task to the control queue."""
    if name == GENERATE_TASK:
        # The registry as it is now (cached), not as it was when this module loaded.
        spec = get_registry().get((kwargs or {}).get("model", ""))
        if spec is not None:
            return {"queue": spec.queue}
    if name == NOTIFY_TASK:
        return {"queue": NOTIFY_QUEUE}
    return {"queue": CONTROL_QUEUE}


task_routes = (route_task,)

# One beat at a time sends the schedule (a lease in Redis), and an embedded beat
# dies with its dispatcher (app/worker/beat.py, tasks/celery_app.py).
beat_scheduler = "batchgen.worker.beat:LockedScheduler"

# Ticks expire unconsumed after a few intervals, so a stalled dispatcher does not
# come back to a pile of identical ticks.
beat_schedule = {
    "dispatch": {
        "task": DISPATCH_TASK,
        "schedule": _settings.worker.dispatch_interval_s,
        "options": {"expires": 5 * _settings.worker.dispatch_interval_s},
    },
    "sweep": {
        "task": SWEEP_TASK,
        "schedule": _settings.worker.sweep_interval_s,
        "options": {"expires": 5 * _settings.worker.sweep_interval_s},
    },
    # Provider jobs of the Batch APIs (app/worker/offload_jobs.py); a no-op while no model
    # of the registry offloads.
    "offload": {
        "task": OFFLOAD_TASK,
        "schedule": _settings.offload.interval_s,
        "options": {"expires": 5 * _settings.offload.interval_s},
    },
    # Batch-finished notifications: host Celery tasks and webhooks (app/worker/notify.py).
    "notify": {
        "task": NOTIFY_TASK,
        "schedule": _settings.webhooks.notify_interval_s,
        "options": {"expires": 5 * _settings.webhooks.notify_interval_s},
    },
    # Finished batches past BATCHGEN_RETENTION_DAYS (a no-op while it is unset).
    "retention": {
        "task": RETENTION_TASK,
        "schedule": _settings.retention.interval_s,
        "options": {"expires": _settings.retention.interval_s},
    },
}

# --- Nightly description jobs (app/nightly, tasks/nightly.py) ----------------
# BATCHGEN_NIGHTLY_CRON (five cron fields, UTC) starts every job of
# BATCHGEN_NIGHTLY_JOBS_FILE; the task does nothing while that is unset.


beat_schedule["nightly-descriptions"] = {
    "task": NIGHTLY_TASK,
    "schedule": cron_schedule(_settings.nightly.cron),
}
