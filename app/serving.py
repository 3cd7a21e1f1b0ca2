"""``batchgen api``: the HTTP API as production runs it, on gunicorn's threaded
workers (``gthread``).

A synchronous call holds its request's thread while it waits for the provider, so a
worker needs as many threads as calls it answers at once (``api_threads``, 64 by
default); several worker processes (``api_workers``) share the machine's cores, each
with its own pools. gunicorn hands the request's socket to the app
(``gunicorn.socket``), so a caller who hangs up during a call is seen and the call
cancelled (:func:`batchgen.api._caller_connected`). A worker's database pool is sized
for its threads unless ``BATCHGEN_DB_POOL_SIZE`` says otherwise (a thread holds a
connection only for a statement, never during a provider call).

The same command line as ``gunicorn -k gthread --threads 64 -w 2
'batchgen.api:create_app()'``.
"""

from __future__ import annotations

import os
from typing import Any

from batchgen.config import Settings, get_settings

# A worker's pool per thread: a thread holds a connection only for a statement.
THREADS_PER_CONNECTION = 8


def pool_size_for(threads: int) -> int:
    """The database pool of a worker of ``threads`` threads."""
    return max(4, -(-threads // THREADS_PER_CONNECTION))


def gunicorn_options(
    settings: Settings, host: str, port: int, workers: int, threads: int
) -> dict[str, Any]:
    """gunicorn's settings for ``batchgen api``."""
    return {
        "bind": f"{host}:{port}",
        "workers": workers,
        "worker_class": "gthread",
        "threads": threads,
        # Idle keep-alive connections (SDK clients reuse theirs).
        "keepalive": 5,
        # A worker asked to stop lets its calls end for this long.
        "graceful_timeout": 5,
        "accesslog": None,
        "errorlog": "-",
        "loglevel": settings.log.level.lower(),
    }


def serve(host: str, port: int, workers: int, threads: int) -> None:
    """Serve :func:`batchgen.api.create_app` (built in each worker) until stopped."""
    from gunicorn.app.base import BaseApplication

    settings = get_settings()
    if settings.database.pool_size is None:
        os.environ["BATCHGEN_DB_POOL_SIZE"] = str(pool_size_for(threads))
        get_settings.cache_clear()
    options = gunicorn_options(settings, host, port, workers, threads)

    class Application(BaseApplication):  # type: ignore[misc]
        def load_config(self) -> None:
            for key, value in options.items():
                self.cfg.set(key, value)

        def load(self) -> Any:
            from batchgen.api import create_app

            return create_app()

    Application().run()
