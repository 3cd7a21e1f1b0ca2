"""No process a pytest run starts outlives it: failed test, Ctrl-C, SIGTERM or exit.

:func:`install` (from tests/conftest.py's ``pytest_configure``, in the main pytest
process and in each xdist worker) does three things:

- **Marks.** ``BATCHGEN_TEST_OWNERS`` in ``os.environ`` gets this process's token
  (``pid-nonce``, after the tokens of the pytest processes above it). Every process
  started from here inherits it, and their children in turn: workers, the dispatcher
  and its beat, the API, the simulator, redis-server, host-project processes, and
  embedded PostgreSQL, which ``pg_ctl`` starts as a daemon no longer our child. A
  child started with an environment of its own gets the mark added
  (:class:`MarkedPopen`).
- **Ties children to us.** A child started from the main thread dies with this
  process (``PR_SET_PDEATHSIG``, SIGKILL), even when pytest itself is SIGKILLed;
  a daemon (embedded PostgreSQL) gets a guard process that stops it then
  (:func:`guard_daemon`).
- **Reaps.** :func:`reap` stops every live process that carries this process's token
  (PostgreSQL with a fast shutdown, the rest with SIGTERM, then SIGKILL after
  :data:`GRACE_S`): at ``pytest_unconfigure`` (after an interrupted session's
  teardown too), at exit and on SIGTERM. A fixture's own teardown stops its
  processes first; this is what catches the ones a failure or an interrupt left.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import uuid
from types import FrameType
from typing import Any

OWNERS_ENV = "BATCHGEN_TEST_OWNERS"
SEPARATOR = ":"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# How long a reaped process may take to stop before it is SIGKILLed: a Celery worker's
# warm shutdown, PostgreSQL's fast shutdown.
GRACE_S = 10.0
# Stopping a process may start another (a worker's beat child is already on its way
# out): look again, at most this many times.
ROUNDS = 3

_token: str | None = None
_guards: list[subprocess.Popen[bytes]] = []  # kept: a guard outlives its caller's frame
_prctl: Any = None  # libc's prctl, looked up before any fork


def owners(environ: dict[str, str]) -> list[str]:
    """The tokens of the pytest processes an environment's process belongs to."""
    return [t for t in environ.get(OWNERS_ENV, "").split(SEPARATOR) if t]


def with_mark(environ: dict[str, str], token: str) -> dict[str, str]:
    """``environ`` with ``token`` among its owners (a copy; the same if it is there)."""
    marks = owners(environ)
    if token in marks:
        return environ
    return {**environ, OWNERS_ENV: SEPARATOR.join([*marks, token])}


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it ends (the
    main thread: when pytest ends, however)."""
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class MarkedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen`` whose child carries this run's mark, and dies with the
    pytest process if started from its main thread (a thread's child would die with
    that thread)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _token is not None and kwargs.get("env") is not None:
            kwargs["env"] = with_mark(dict(kwargs["env"]), _token)
        main = threading.current_thread() is threading.main_thread()
        if main and _prctl is not None and kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = _die_with_parent
        super().__init__(*args, **kwargs)


def install() -> str:
    """Mark this process's children, tie them to it and reap them at the end; returns
    this process's token (once per process: a second call returns the first token)."""
    global _token, _prctl
    if _token is not None:
        return _token
    _token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.environ.update(with_mark(dict(os.environ), _token))
    with contextlib.suppress(OSError, AttributeError):  # not Linux: marks and reaping only
        _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    subprocess.Popen = MarkedPopen  # type: ignore[misc]
    atexit.register(reap)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    return _token


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Reap, then end as SIGTERM would have ended us."""
    reap()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


# A guard of a daemon (PostgreSQL, which pg_ctl starts outside our process tree): it
# waits for SIGTERM, sent when its parent ends however (PR_SET_PDEATHSIG) or by
# reap(), then gives the daemon a fast shutdown if it is still the same process.
GUARD = """
import ctypes, os, signal, sys
parent, pid, started = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
ctypes.CDLL("libc.so.6").prctl(1, int(signal.SIGTERM), 0, 0, 0)
if os.getppid() == parent:
    signal.sigwait({signal.SIGTERM})
try:
    if open(f"/proc/{pid}/stat").read().split()[21] == started:
        os.kill(pid, signal.SIGINT)
except OSError:
    pass
"""


def guard_daemon(pid: int) -> None:
    """Stop daemon ``pid`` (PostgreSQL: SIGINT is its fast shutdown) when this process
    ends, even by SIGKILL, unless it has stopped by then."""
    import sys

    with open(f"/proc/{pid}/stat") as stat:
        started = stat.read().split()[21]  # its start time: the same process, not a reuse
    argv = [sys.executable, "-c", GUARD, str(os.getpid()), str(pid), started]
    _guards.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True))


def marked_processes(token: str) -> list[Any]:
    """Live processes (not zombies, not this one) carrying ``token`` in their mark."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if token in owners(proc.environ()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):  # gone, or not ours to read
            continue
    return found


def _stop_signal(proc: Any) -> int:
    """PostgreSQL's fast shutdown (SIGTERM would wait for its clients), else SIGTERM."""
    try:
        return signal.SIGINT if proc.name() == "postgres" else signal.SIGTERM
    except Exception:
        return signal.SIGTERM


def reap(token: str | None = None, grace_s: float = GRACE_S) -> list[int]:
    """Stop every process marked with ``token`` (this process's by default); returns
    the pids found."""
    import psutil

    token = token or _token
    if token is None:
        return []
    reaped: list[int] = []
    for _ in range(ROUNDS):
        procs = marked_processes(token)
        if not procs:
            break
        reaped += [p.pid for p in procs]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(_stop_signal(proc))
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=grace_s)
    for guard in _guards:  # reaped above (or ended): its Popen learns it, and does not
        guard.poll()  # warn at exit that it is "still running"
    return reaped
