"""The Celery application (:mod:`batchgen.worker.publish`) and the worker's signals;
``celery -A batchgen.tasks worker`` starts a worker."""

import os
import sys
from pathlib import Path
from typing import Any

from celery import signals

from batchgen.logs import configure_logging
from batchgen.providers import get_provider
from batchgen.registry import get_registry
from batchgen.worker.beat import die_with_parent
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


@signals.beat_embedded_init.connect
def _beat_dies_with_worker(**_: Any) -> None:
    # A beat embedded in a dispatcher (-B) is a child process: without this, a
    # `kill -9` of the dispatcher leaves it sending ticks as an orphan.
    die_with_parent()


@signals.worker_ready.connect
def _warm_up(**_: Any) -> None:
    # Import the provider SDKs now rather than inside the first call: a call
    # admitted by the budget must reach the provider promptly.
    for spec in get_registry():
        get_provider(spec)
    # Tells a supervisor (batchgen.worker.procs, tests, benchmarks) that we consume now.
    ready_file = os.environ.get("BATCHGEN_READY_FILE")
    if ready_file:
        Path(ready_file).touch()
