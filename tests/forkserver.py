"""Processes of the suite forked from one that has already imported their libraries.

Most of a Celery worker's start in this suite is imports: Celery, kombu, redis,
SQLAlchemy, pydantic, the OpenAI and Anthropic SDKs (about 2 s of CPU each on a 2-core
machine, for some 300 worker starts a run). A fork server, one per pytest process,
imports those third-party libraries once (:data:`PRELOAD`, never batchgen itself: its
settings and the Celery app's configuration are read from the environment, so each
child imports them after it has its own) and forks a child per command. The child is
what ``subprocess.Popen(argv, env=env)`` would have run for ``python -m <module> ...``:
its own session (process group), the environment given, stdout and stderr to the log,
``sys.argv`` as ``python -m`` sets it, Python's exit code, and it dies with the server
(which dies with pytest: its requests pipe closes).

``BATCHGEN_TEST_FORK=0`` runs every worker by ``exec`` again (:func:`enabled`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SWITCH_ENV = "BATCHGEN_TEST_FORK"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
CLONE_NEWNET = 0x40000000  # <linux/sched.h>
NETNS_DIR = Path("/var/run/netns")  # where ``ip netns add`` names a network namespace

# Third-party modules a worker imports, loaded once in the server. Only libraries that
# read no batchgen setting at import, and start no thread (a fork copies one thread).
PRELOAD = (
    "celery",
    "celery.bin.celery",
    "celery.apps.worker",
    "celery.worker.consumer",
    "celery.concurrency.thread",
    "celery.beat",
    "kombu.transport.redis",
    "kombu.transport.pyamqp",
    "redis",
    "sqlalchemy",
    "sqlalchemy.orm",
    "sqlalchemy.dialects.postgresql.psycopg",
    "psycopg",
    "pydantic",
    "pydantic_settings",
    "httpx",
    "openai",
    "anthropic",
    "tiktoken",
    "prometheus_client",
    "opentelemetry.sdk.trace",
    "opentelemetry.sdk.metrics",
    "alembic",
    "flask",
    "gunicorn.app.base",
    "gunicorn.workers.gthread",
    # What else a worker has loaded when ready (``python -X importtime``): the HTTP
    # clients' async back-ends, Celery's command-line plugins (Flower's, click-repl's).
    "httpx2",
    "httpcore2",
    "trio",
    "aiohttp",
    "anyio",
    "h11",
    "urllib3",
    "httptools",
    "click",
    "click_repl",
    "typer",
    "prompt_toolkit",
    "wcwidth",
    "pygments",
    "rich",
    "yaml",
    "attr",
    "psutil",
    "dateutil",
    "amqp",
    "billiard",
    "flower.command",
    "tornado.web",
)


# batchgen's own modules that read nothing from the environment at import (no setting,
# no registry, no connection: :func:`serve` checks that the settings' and registry's
# caches are still empty), loaded once too: the store's statements and tables, settings
# and registry classes (about 0.2 s of each start).
BATCHGEN_PRELOAD = (
    "batchgen.config",
    "batchgen.registry",
    "batchgen.store.schema",
    "batchgen.store.items",
    "batchgen.providers.base",
)


def enabled() -> bool:
    """Fork the suite's workers (the default on Linux), unless ``BATCHGEN_TEST_FORK=0``."""
    return sys.platform == "linux" and os.environ.get(SWITCH_ENV, "1") != "0"


# --- The server (its own process) -----------------------------------------------------


def serve() -> None:
    """Preload, then answer requests (one JSON line each on stdin, one reply on stdout)
    until stdin closes: ``spawn`` forks a child, ``poll`` reaps one."""
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    for name in BATCHGEN_PRELOAD:
        importlib.import_module(name)
    from batchgen.config import _process_settings
    from batchgen.registry import load_registry

    if _process_settings.cache_info().currsize or load_registry.cache_info().currsize:
        raise SystemExit("fork server: batchgen's settings were read while preloading")
    if threading.active_count() != 1:  # a fork would copy a thread's locks, not the thread
        raise SystemExit(f"fork server: {threading.active_count()} threads after preloading")
    # A Ctrl-C reaches the pytest process group, this server with it: the server stays
    # until its requests pipe closes, so that pytest's teardown can still stop its
    # children (which have sessions of their own, and Python's handler back).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    codes: dict[int, int] = {}
    for line in requests:
        request = json.loads(line)
        if request["op"] == "spawn":
            reply: dict[str, Any] = {"pid": _fork(request)}
        else:
            reply = {"returncode": _reap(int(request["pid"]), codes)}
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


def _reap(pid: int, codes: dict[int, int]) -> int | None:
    if pid in codes:
        return codes[pid]
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -int(signal.SIGKILL)  # not ours to wait for: gone
    if done == 0:
        return None
    codes[pid] = os.waitstatus_to_exitcode(status)
    return codes[pid]


def _fork(request: dict[str, Any]) -> int:
    server = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(
            PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0
        )
        if os.getppid() != server:  # the server ended before the line above
            os._exit(1)
        if request.get("netns"):
            _enter_netns(str(request["netns"]))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _become(request)
        code = _run(list(request["argv"]))
    except BaseException:  # noqa: BLE001 - the child's last word goes to its log
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    raise AssertionError("unreachable")


def _enter_netns(name: str) -> None:
    """Join network namespace ``name`` as ``ip netns exec NAME`` does for its command."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def _become(request: dict[str, Any]) -> None:
    """The child's process state as ``subprocess.Popen`` would have set it."""
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]


def _run(argv: list[str]) -> int:
    """``python -m <module> args...`` in this process; Python's exit code."""
    import runpy

    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"fork server runs python -m <module> only, not {argv}")
    module = argv[2]
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None else module
    package = spec is not None and spec.submodule_search_locations is not None
    main = importlib.util.find_spec(f"{module}.__main__") if package else None
    sys.argv = [str(main.origin if main is not None else origin), *argv[3:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    threading._shutdown()  # type: ignore[attr-defined]  # as Python's own exit
    import atexit

    atexit._run_exitfuncs()
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# --- The client (a pytest process) ------------------------------------------------------


class ForkServer:
    """One fork server (started on first use), shared by the threads of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None

    def _server(self) -> subprocess.Popen[bytes]:
        if self._process is not None and self._process.poll() is not None:
            for pipe in (self._process.stdin, self._process.stdout):  # a dead server's
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            self._process = None
        if self._process is None:
            log_path = Path(tempfile.gettempdir()) / f"batchgen-forkserver-{os.getpid()}.log"
            with open(log_path, "ab") as log:
                self._process = subprocess.Popen(
                    [sys.executable, "-c", "from tests.forkserver import serve; serve()"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                )
        return self._process

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            server = self._server()
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(json.dumps(request).encode() + b"\n")
            server.stdin.flush()
            line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server ended (exit {server.poll()})")
        return dict(json.loads(line))

    def spawn(
        self, argv: list[str], env: dict[str, str], log_path: Path, netns: str | None = None
    ) -> ForkedProcess:
        # The log exists once spawn returns, as with Popen and a file the caller opened:
        # the child opens it only after its fork, and a test may read it before then.
        with open(log_path, "ab"):
            pass
        request = {"op": "spawn", "argv": argv, "env": env, "log": str(log_path)}
        request["cwd"] = os.getcwd()
        request["netns"] = netns
        return ForkedProcess(self, argv, int(self.ask(request)["pid"]))


class ForkedProcess:
    """The part of ``subprocess.Popen`` the suite uses, for a child of the fork server."""

    def __init__(self, server: ForkServer, args: list[str], pid: int) -> None:
        self.server, self.args, self.pid = server, args, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.ask({"op": "poll", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_SERVER = ForkServer()


def spawn(
    argv: list[str], env: dict[str, str], log_path: Path, netns: str | None = None
) -> ForkedProcess:
    """Run ``argv`` (``python -m <module> ...``) as a child of this process's fork server;
    in network namespace ``netns`` (by its ``ip netns`` name) if given."""
    return _SERVER.spawn(argv, env, log_path, netns)
