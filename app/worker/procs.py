"""Starting Celery worker processes (for the demo, the tests and the benchmarks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

#: The only Celery pool batchgen workers run: provider calls are I/O-bound, and the
#: worker's state (database and Redis connection pools, leases, stop events) is per process.
WORKER_POOL = "threads"


def pool_error(pool: str) -> str | None:
    """Why ``pool`` cannot run batchgen's tasks, or ``None`` for the supported pool."""
    if pool in (WORKER_POOL, "thread", "celery.concurrency.thread:TaskPool"):
        return None
    return (
        f"pool {pool!r} is not supported: batchgen workers run Celery's thread pool only "
        f"(-P {WORKER_POOL}); use --concurrency for more parallel calls"
    )


def requested_pool(argv: list[str]) -> str | None:
    """The pool asked for on a ``celery worker`` command line (``-P x``, ``-Px``,
    ``--pool x``, ``--pool=x``), else ``None``."""
    for i, arg in enumerate(argv):
        if arg in ("-P", "--pool"):
            return argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("--pool="):
            return arg.split("=", 1)[1]
        if arg.startswith("-P") and not arg.startswith("--"):
            return arg[2:]
    return None


class Process(Protocol):
    """What :class:`WorkerProcess` needs of its process (``subprocess.Popen``'s part)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


#: Starts a worker's command line: ``(argv, env, log_path) -> process``, its output
#: appended to ``log_path``, in a session of its own.
Spawn = Callable[[list[str], dict[str, str], Path], Process]


def exec_spawn(argv: list[str], env: dict[str, str], log_path: Path) -> Process:
    """:data:`Spawn` by ``subprocess.Popen`` (the default)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


#: How :func:`start_worker` starts a worker when not told: the test suite forks its
#: workers from a process that has their libraries imported (tests/forkserver.py).
default_spawn: Spawn = exec_spawn


@dataclass
class WorkerProcess:
    name: str
    process: Process
    log_path: Path
    ready_path: Path

    def wait_ready(self, timeout_s: float = 60.0) -> WorkerProcess:
        """Block until the worker logs that it consumes its queues."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited: {self.log_tail()}")
            if self.ready_path.exists():
                return self
            time.sleep(0.1)
        raise RuntimeError(f"worker {self.name} not ready after {timeout_s}s: {self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the worker's process group: no warm shutdown, no acks."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL if it takes too long."""
        stop_all([self], timeout_s)


def stop_all(workers: list[WorkerProcess], timeout_s: float = 15.0) -> None:
    """Warm shutdown of every worker at once (SIGTERM to all, then the waits), then
    SIGKILL for any still running after ``timeout_s``."""
    running = [w for w in workers if w.process.poll() is None]
    for w in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for w in running:
        try:
            w.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()


def start_worker(
    queues: list[str],
    *,
    log_dir: Path,
    concurrency: int = 8,
    beat: bool = False,
    env: dict[str, str] | None = None,
    name: str | None = None,
    gossip: bool = False,
    spawn: Spawn | None = None,
) -> WorkerProcess:
    """Start ``celery worker`` (thread pool) in its own process group; ``gossip``: with
    Celery's gossip and mingle steps, as ``batchgen worker`` runs them; ``spawn``: how
    (:data:`default_spawn` when not given)."""
    name = name or f"w{uuid.uuid4().hex[:6]}"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    ready_path = log_dir / f"{name}.ready"
    ready_path.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "batchgen.tasks",
        "worker",
        "-Q",
        ",".join(queues),
        "-P",
        WORKER_POOL,
        "-c",
        str(concurrency),
        "-n",
        f"{name}@%h",
        "--loglevel",
        "INFO",
    ]
    if not gossip:
        argv += ["--without-mingle", "--without-gossip"]
    if beat:
        argv += ["-B", "-s", str(log_dir / f"{name}-beat-schedule")]
    log_path.write_bytes(b"")
    environ = {**os.environ, **(env or {}), "BATCHGEN_READY_FILE": str(ready_path)}
    process = (spawn or default_spawn)(argv, environ, log_path)
    return WorkerProcess(name, process, log_path, ready_path)


def beat_pids(worker_pid: int) -> list[int]:
    """The embedded beat process of a worker started with beat (``batchgen dispatcher``,
    ``celery worker -B``): its live child processes, as the thread pool forks no other."""
    import psutil

    try:
        children = psutil.Process(worker_pid).children()
    except psutil.NoSuchProcess:
        return []
    alive = []
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child.pid)
    return alive
