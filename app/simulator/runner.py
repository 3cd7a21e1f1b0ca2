"""Running the simulator: blocking in the foreground, or in a background thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from aiohttp import web

from batchgen.simulator.server import STATE, create_app
from batchgen.simulator.sim_config import SimulatorConfig
from batchgen.simulator.state import SimState

BACKLOG = 2048
SHUTDOWN_TIMEOUT_S = 1.0


def run_simulator(host: str, port: int, config: SimulatorConfig | None = None) -> None:
    """Serve the simulator on ``host:port`` until interrupted (blocking, no access log)."""
    web.run_app(
        create_app(config),
        host=host,
        port=port,
        access_log=None,
        backlog=BACKLOG,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        print=None,
    )


class SimulatorThread:
    """The simulator in a background thread with its own event loop.

    Use as a context manager (or call :meth:`start` / :meth:`stop`). ``port=0``
    binds a free port; :attr:`base_url` is then e.g. ``"http://127.0.0.1:41234"``
    (OpenAI clients use ``base_url + "/v1"``, Anthropic clients ``base_url``).

    :meth:`refusing_connections` makes the provider unreachable for a while:
    the listening socket is closed, so every connect is refused by the kernel
    (a real ``ECONNREFUSED``, the request never leaves the client).
    """

    def __init__(
        self, config: SimulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.config = config or SimulatorConfig()
        self.host = host
        self.port = port
        self.app = create_app(self.config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> SimState:
        """The in-process :class:`~batchgen.simulator.state.SimState` (read-only use from tests)."""
        return self.app[STATE]

    def start(self) -> SimulatorThread:
        """Start serving; returns once the port is bound (raises if it could not be)."""
        self._thread = threading.Thread(target=self._run, name="simulator", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._error is not None:
            raise RuntimeError("simulator failed to start") from self._error
        if not self._ready.is_set():
            raise RuntimeError("simulator did not start within 30 s")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            assert self._runner is not None
            loop.run_until_complete(self._runner.cleanup())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _setup(self) -> None:
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        await self._runner.setup()
        await self._listen()

    async def _listen(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, self.host, self.port, backlog=BACKLOG)
        await self._site.start()
        self.port = int(self._runner.addresses[0][1])

    async def _stop_listening(self) -> None:
        assert self._runner is not None and self._site is not None
        await self._site.stop()
        self._site = None
        # Idle keep-alive connections close too (requests in progress finish first),
        # so a client cannot reuse one: its next request must connect, and is refused.
        if self._runner.server is not None:
            self._runner.server.pre_shutdown()
        await asyncio.sleep(0.05)

    def _run_in_loop(self, coro: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    @contextmanager
    def refusing_connections(self) -> Iterator[None]:
        """While inside, nothing listens on the simulator's port: connects are refused.

        On exit the simulator listens on the same port again (state, log and
        counters are kept).
        """
        self._run_in_loop(self._stop_listening())
        try:
            yield
        finally:
            self._run_in_loop(self._listen())

    def stop(self) -> None:
        """Stop the server and join the thread (in-flight requests are cancelled)."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._thread = None

    def __enter__(self) -> SimulatorThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
