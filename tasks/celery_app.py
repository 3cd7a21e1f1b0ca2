"""The Celery application (:mod:`batchgen.worker.publish`) and the worker's signals;
``celery -A batchgen.tasks worker`` starts a worker."""

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from celery import signals

from batchgen.config import get_settings
from batchgen.logs import configure_logging
from batchgen.providers import get_provider
from batchgen.registry import get_registry, served_models
from batchgen.telemetry import tracing
from batchgen.worker import broker_guard
from batchgen.worker.beat import die_with_parent
from batchgen.worker.clock import redis_offset_s
from batchgen.worker.lifecycle import (
    exit_at_once_after_shutdown,
    is_worker_command,
    wake_loop_on_signals,
)
from batchgen.worker.presence import Presence, consumed_queues
from batchgen.worker.procs import pool_error, requested_pool
from batchgen.worker.publish import celery_app

__all__ = ["celery_app"]


@signals.setup_logging.connect
def _setup_logging(**_: Any) -> None:
    # Connecting here also stops Celery from replacing our handlers.
    configure_logging()


@signals.celeryd_init.connect
def _refuse_other_pools(**_: Any) -> None:
    # Celery takes an explicit "-P prefork" for its default and silently runs the
    # configured pool instead; refuse any pool but threads rather than swap it.
    message = pool_error(requested_pool(sys.argv[1:]) or str(celery_app.conf.worker_pool))
    if message:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


@signals.worker_init.connect
def _telemetry(**_: Any) -> None:
    # Traces and metrics in the GenAI conventions, if the OTEL_* variables say so.
    tracing.setup_from_env("batchgen-worker")


@signals.worker_init.connect
def _guard_the_redis_transport(**_: Any) -> None:
    # A lost broker must not end the worker (app/worker/broker_guard.py).
    broker_guard.install()


@signals.worker_init.connect
def _pool_follows_threads(sender: Any = None, **_: Any) -> None:
    # The default database pool is a quarter of the worker's threads (README
    # "Connections"): of the threads this worker really runs (-c, --concurrency), not
    # only of BATCHGEN_WORKER_CONCURRENCY. No connection is open yet at this point.
    threads = getattr(sender, "concurrency", None)
    if isinstance(threads, int) and threads > 0 and threads != get_settings().worker.concurrency:
        os.environ["BATCHGEN_WORKER_CONCURRENCY"] = str(threads)
        get_settings.cache_clear()


@signals.worker_init.connect
def _declare_every_queue(**_: Any) -> None:
    # RabbitMQ: Celery's native delayed delivery binds every queue of the app to its
    # delay exchanges when a worker starts, also the queues this worker does not
    # consume; on a fresh vhost those do not exist yet and the binding fails with
    # NOT_FOUND. Declaring them all first (idempotent) avoids that. Best effort: a
    # broker that is down now is retried by the worker itself.
    from batchgen.celeryconfig import is_amqp

    if not is_amqp(str(celery_app.conf.broker_url)):
        return
    with contextlib.suppress(Exception), celery_app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1)
        channel = connection.channel()
        for queue in celery_app.amqp.queues.values():
            queue.bind(channel).declare()
        channel.close()


@signals.beat_embedded_init.connect
def _beat_dies_with_worker(**_: Any) -> None:
    # A beat embedded in a dispatcher (-B) is a child process: without this, a
    # `kill -9` of the dispatcher leaves it sending ticks as an orphan.
    die_with_parent()


# Stopping (SIGTERM, Ctrl-C) starts at once and ends with the process, without the
# interpreter's teardown: about two seconds less per restart. Only in a process started
# as a worker; a program running a worker inside it keeps its own signals and exit.
@signals.worker_ready.connect
def _stop_promptly(sender: Any = None, **_: Any) -> None:
    hub = getattr(sender, "hub", None)
    if hub is not None and is_worker_command(sys.argv):
        with contextlib.suppress(ValueError):  # not the main thread: wakes as before
            wake_loop_on_signals(hub)


@signals.worker_ready.connect
def _warm_up(sender: Any = None, **_: Any) -> None:
    # Import the provider SDKs of the models this worker's queues serve and build their
    # clients now rather than inside the first call (about 120 ms once per process): a
    # call admitted by the budget must reach the provider promptly. A model whose key is
    # missing fails at its call. BATCHGEN_WARM_UP=false: at each model's first call.
    if get_settings().providers.warm_up:
        queues = consumed_queues(sender, sorted(celery_app.amqp.queues.consume_from or {}))
        for spec in served_models(get_registry(), queues()):
            with contextlib.suppress(Exception):
                get_provider(spec).warm(spec)
    redis_offset_s()  # this host's offset from Redis's clock, measured in the background
    # Tells a supervisor (batchgen.worker.procs, tests, benchmarks) that we consume now.
    ready_file = os.environ.get("BATCHGEN_READY_FILE")
    if ready_file:
        Path(ready_file).touch()


_presence: list[Presence] = []


# The status view lists the live workers from what they announce in Redis
# (app/worker/presence.py), not by a broadcast that waits for their replies.
@signals.worker_ready.connect
def _announce(sender: Any = None, **_: Any) -> None:
    hostname = getattr(sender, "hostname", None)
    if hostname is None:
        return
    fallback = sorted(celery_app.amqp.queues.consume_from or {})
    _presence.append(Presence(str(hostname), consumed_queues(sender, fallback)).start())


@signals.worker_shutdown.connect
def _withdraw(**_: Any) -> None:
    while _presence:
        _presence.pop().stop()
    tracing.shutdown()  # what the exporters still hold goes out


@signals.worker_shutdown.connect
def _exit_at_once(sender: Any = None, **_: Any) -> None:
    if is_worker_command(sys.argv):
        exit_at_once_after_shutdown(lambda: getattr(sender, "exitcode", None))
