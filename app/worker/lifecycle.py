"""A worker process's own start and end: a shutdown that begins as soon as the signal
comes, and an exit that skips the interpreter's teardown once the worker has shut down."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def wake_loop_on_signals(hub: Any) -> None:
    """Make a signal end the wait of the worker's event loop (kombu's hub) at once.

    Celery's handlers for SIGTERM and SIGINT only mark the worker to stop; the loop
    sees that after its poll returns, up to a second later. With the interpreter's
    wake-up pipe registered on the hub, every signal ends the poll. Main thread only
    (Celery's consumer runs there); a hub reset (a lost broker) drops the pipe, and
    the loop then wakes as before."""
    reader, writer = os.pipe()
    os.set_blocking(reader, False)
    os.set_blocking(writer, False)
    signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
    hub.add_reader(reader, _drain, reader)


def _drain(fd: int) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass


def is_worker_command(argv: list[str]) -> bool:
    """Whether ``argv`` (``sys.argv``) starts a worker from a command line: ``celery ...
    worker`` (or ``python -m celery``), ``batchgen worker`` or ``batchgen dispatcher``,
    not a program that runs a worker inside itself."""
    if not argv:
        return False
    program = Path(argv[0])
    name = program.parent.name if program.name == "__main__.py" else program.name
    if name == "celery":
        return "worker" in argv[1:]
    if name in ("batchgen", "cli"):
        return any(word in argv[1:] for word in ("worker", "dispatcher"))
    return False


def exit_at_once_after_shutdown(exitcode: Callable[[], int | None]) -> None:
    """Once a worker process has shut down (its calls ended, its messages acked or
    handed back, its connections closed), end the process without tearing down the
    interpreter, which frees every object one by one: about a second once the SDKs and
    tokenizers are loaded, on every restart. Logs and output are flushed first; the exit
    code is the worker's (``exitcode()``, 0 if it set none). Runs as the first exit
    handler, so none registered before it runs."""
    atexit.register(_exit_now, exitcode)


def _exit_now(exitcode: Callable[[], int | None]) -> None:
    code = exitcode() or 0
    log.info("worker shut down; exit code %d", code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
