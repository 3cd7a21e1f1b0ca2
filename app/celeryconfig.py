"""Celery settings, read from the one settings object (batchgen.config) and the model registry.

Queues: one per model group (``llm.<group>``, from the registry) and
``batchgen.control`` for the dispatcher and the sweep. Messages carry ids
only; results live in PostgreSQL, so Celery keeps none.
"""

from kombu import Queue

from batchgen.config import get_settings
from batchgen.registry import get_registry
from batchgen.worker.beat import cron_schedule
from batchgen.worker.names import (
    CONTROL_QUEUE,
    DISPATCH_TASK,
    GENERATE_TASK,
    NIGHTLY_TASK,
    NOTIFY_TASK,
    OFFLOAD_TASK,
    RETENTION_TASK,
    SWEEP_TASK,
)

_settings = get_settings()
_registry = get_registry()

broker_url = _settings.broker_url
broker_connection_retry_on_startup = True
broker_transport_options = {
    # Unacked messages return after this; every countdown we use is far shorter.
    "visibility_timeout": _settings.visibility_timeout_s,
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
worker_concurrency = _settings.worker_concurrency
worker_hijack_root_logger = False

# Flower and events: task names are readable, arguments are ids only. Workers send
# the task events; publishers send none (a "sent" event cannot be turned off per
# task, and the dispatch tick every second and the sweep would bury the items'
# tasks under PENDING entries). The dispatch and sweep tasks send no events at all.
worker_send_task_events = True
task_send_sent_event = False

task_queues = [Queue(CONTROL_QUEUE)] + [Queue(q) for q in _registry.queues]
task_default_queue = CONTROL_QUEUE


def route_task(name, args, kwargs, options, task=None, **kw):  # type: ignore[no-untyped-def]
    """Each item goes to its model group's queue (one worker pool per group); every
    other task to the control queue."""
    if name == GENERATE_TASK:
        spec = _registry.get((kwargs or {}).get("model", ""))
        if spec is not None:
            return {"queue": spec.queue}
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
        "schedule": _settings.dispatch_interval_s,
        "options": {"expires": 5 * _settings.dispatch_interval_s},
    },
    "sweep": {
        "task": SWEEP_TASK,
        "schedule": _settings.sweep_interval_s,
        "options": {"expires": 5 * _settings.sweep_interval_s},
    },
    # Provider jobs of the Batch APIs (app/worker/offload.py); a no-op while no model
    # of the registry offloads.
    "offload": {
        "task": OFFLOAD_TASK,
        "schedule": _settings.offload_interval_s,
        "options": {"expires": 5 * _settings.offload_interval_s},
    },
    # Batch-finished notifications: host Celery tasks and webhooks (app/worker/notify.py).
    "notify": {
        "task": NOTIFY_TASK,
        "schedule": _settings.notify_interval_s,
        "options": {"expires": 5 * _settings.notify_interval_s},
    },
    # Finished batches past BATCHGEN_RETENTION_DAYS (a no-op while it is unset).
    "retention": {
        "task": RETENTION_TASK,
        "schedule": _settings.retention_interval_s,
        "options": {"expires": _settings.retention_interval_s},
    },
}

# --- Nightly description jobs (app/nightly, tasks/nightly.py) ----------------
# BATCHGEN_NIGHTLY_CRON (five cron fields, UTC) starts every job of
# BATCHGEN_NIGHTLY_JOBS_FILE; the task does nothing while that is unset.


beat_schedule["nightly-descriptions"] = {
    "task": NIGHTLY_TASK,
    "schedule": cron_schedule(_settings.nightly_cron),
}
