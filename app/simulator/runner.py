"""Running the simulator: blocking in the foreground, or in a background thread."""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType

from aiohttp import web

from app.simulator.config import SimulatorConfig
from app.simulator.server import STATE, create_app
from app.simulator.state import SimState

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
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> SimState:
        """The in-process :class:`~app.simulator.state.SimState` (read-only use from tests)."""
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
        site = web.TCPSite(self._runner, self.host, self.port, backlog=BACKLOG)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

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
