"""Integration fixtures: the provider simulator and real Celery worker processes.

Every test collected under this folder carries the ``integration`` marker
(``pytestmark`` in a conftest.py marks nothing, so :func:`pytest_collection_modifyitems`
does it). A test that takes more than a few seconds (7 s or more, setup, call and
teardown, in a run of ``pytest --durations=0 tests/integration`` on a 2-core machine)
says so itself: ``@pytest.mark.slow`` on the test, or ``pytest.mark.slow`` in its
module's ``pytestmark`` when every test of the file is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from batchgen.worker import procs
from batchgen.worker.procs import WorkerProcess, start_worker, stop_all
from tests import http_client
from tests.waiting import poll_until

HERE = Path(__file__).resolve().parent
CONTROL_QUEUE = "batchgen.control"
NOTIFY_QUEUE = "batchgen.notify"


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect anything
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of this folder ``integration``.

    A conftest's hook sees every collected item, so it picks this folder's by path."""
    for item in items:
        if Path(item.path).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def simulator() -> Iterator[object]:
    """The provider simulator over real HTTP (latency 50 ms + 0.5 ms per output token)."""
    from batchgen.config import get_settings
    from batchgen.registry import load_registry
    from batchgen.simulator import SimulatorConfig, SimulatorThread

    config = SimulatorConfig(latency_base_ms=50, latency_per_token_ms=0.5, seed=1)
    with SimulatorThread(config) as sim:
        os.environ["BATCHGEN_SIMULATOR_URL"] = sim.base_url
        get_settings.cache_clear()
        load_registry.cache_clear()  # its base URLs expand BATCHGEN_SIMULATOR_URL
        yield sim
        os.environ.pop("BATCHGEN_SIMULATOR_URL", None)
        load_registry.cache_clear()


@contextlib.contextmanager
def worker_processes(log_dir: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker processes on demand (logs in ``log_dir``); all are stopped (or
    killed) at the end of the block."""
    started: list[WorkerProcess] = []

    def start(
        queues: list[str] | None = None,
        *,
        concurrency: int = 8,
        beat: bool = True,
        env: dict[str, str] | None = None,
        name: str | None = None,
        wait: bool = True,
        gossip: bool = False,
    ) -> WorkerProcess:
        from batchgen.registry import get_registry

        qs = queues or [*get_registry().queues, CONTROL_QUEUE, NOTIFY_QUEUE]
        w = start_worker(
            qs,
            log_dir=log_dir,
            concurrency=concurrency,
            beat=beat,
            env=env,
            name=name,
            gossip=gossip,
        )
        started.append(w)
        return w.wait_ready() if wait else w

    try:
        yield start
    finally:
        stop_all(started)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """:func:`worker_processes` for one test."""
    with worker_processes(tmp_path / "logs") as start:
        yield start


@pytest.fixture(scope="module")
def module_workers(
    services: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., WorkerProcess]]:
    """:func:`worker_processes` for a module's tests. They outlive each test's
    ``clean_db``, which keeps the broker's bindings for them."""
    with worker_processes(tmp_path_factory.mktemp("workers") / "logs") as start:
        yield start


@pytest.fixture
def restore_env() -> Iterator[None]:
    """Put ``os.environ`` back as it was after the test and forget the cached settings
    (for tests whose host-app config exports ``BATCHGEN_*`` variables)."""
    from batchgen.config import get_settings

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    get_settings.cache_clear()


@contextlib.contextmanager
def api_servers(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start ``batchgen api`` as a real server process on a free port (environment
    overrides per call); returns its base URL. Every one started is stopped at the end."""
    import sys

    import httpx

    from batchgen.embedded import free_port

    started: list[procs.Process] = []

    def start(env: dict[str, str] | None = None, timeout_s: float = 60.0) -> str:
        port = free_port()
        log_dir = tmp_path / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "batchgen.cli", "api"]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        log_path = log_dir / f"api-{port}.log"
        log_path.write_bytes(b"")
        # One gunicorn worker unless a test asks for more: half the start-up (each
        # worker loads the SDKs and encodings) on a busy test machine.
        environ = {**os.environ, "BATCHGEN_API_WORKERS": "1", **(env or {})}
        process = procs.default_spawn(argv, environ, log_path)  # forked, as workers are
        started.append(process)
        base_url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            if process.poll() is not None:
                log_text = (log_dir / f"api-{port}.log").read_text()
                raise RuntimeError(f"API server exited: {log_text}")
            try:
                return http_client.get(f"{base_url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        if not poll_until(healthy, timeout_s):
            raise RuntimeError(f"API server not up after {timeout_s}s")
        return base_url

    try:
        yield start
    finally:
        _stop_servers(started)


def _stop_servers(started: list[Any]) -> None:
    import signal
    import subprocess

    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """:func:`api_servers` for one test."""
    with api_servers(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def module_api_server(
    services: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., str]]:
    """:func:`api_servers` for a module's tests (the servers outlive each test's
    ``clean_db``: they keep no state of their own)."""
    with api_servers(tmp_path_factory.mktemp("api")) as start:
        yield start
