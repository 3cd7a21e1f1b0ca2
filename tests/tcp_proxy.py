"""A small TCP proxy that a test can cut and restore (a network fault on demand).

``cut()`` closes every connection going through it and stops listening, so
new connections are refused; ``restore()`` listens again on the same port.
While ``hold`` is set, bytes from clients wait until ``release`` is set (a
server that stalls); ``held`` tells that something was held.
Threads only: one accept loop, one pump per direction of each connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from types import TracebackType

from tests.waiting import poll_until

CHUNK_BYTES = 1 << 16


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream``; ``cut()`` / ``restore()`` on demand."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        port: int = 0,
        *,
        upstream_unix: str | None = None,
        listen_host: str = "127.0.0.1",
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host  # the address clients connect to
        self.upstream_unix = upstream_unix  # a Unix socket path instead of host and port
        self.port = port
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._sockets: set[socket.socket] = set()
        self.accepted = 0  # connections accepted since start (proof that clients used us)
        self.cuts = 0
        self.hold = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> TcpProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.listen_host, self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._accepter = threading.Thread(
            target=self._accept_loop, args=(listener,), name=f"proxy-{self.port}", daemon=True
        )
        self._accepter.start()
        return self

    def cut(self) -> int:
        """Stop listening and close every open connection; returns how many were closed."""
        self.cuts += 1
        self._close_listener()
        with self._lock:
            open_sockets = list(self._sockets)
            self._sockets.clear()
        for sock in open_sockets:
            _close(sock)
        return len(open_sockets) // 2

    def restore(self) -> None:
        """Listen again on the same port."""
        if self._listener is None:
            self.start()

    def stop(self) -> None:
        self.release.set()
        self.cut()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._sockets) // 2

    # -- internals -------------------------------------------------------------
    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            # shutdown() wakes the thread blocked in accept(); close() alone may not.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        if self._accepter is not None:
            self._accepter.join(5)
            self._accepter = None

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed by cut()
            if self._listener is not listener:
                _close(client)
                return
            try:
                server = self._connect_upstream()
            except OSError:
                _close(client)  # upstream down: the client sees its connection closed
                continue
            with self._lock:
                self._sockets.update((client, server))
                self.accepted += 1
            for src, dst, from_client in ((client, server, True), (server, client, False)):
                threading.Thread(
                    target=self._pump, args=(src, dst, from_client), daemon=True
                ).start()

    def _connect_upstream(self) -> socket.socket:
        if self.upstream_unix is None:
            server = socket.create_connection(self.upstream, timeout=5)
        else:
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.settimeout(5)
            try:
                server.connect(self.upstream_unix)
            except OSError:
                server.close()
                raise
        server.settimeout(None)
        return server

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while True:
                data = src.recv(CHUNK_BYTES)
                if not data:
                    break
                if from_client and self.hold.is_set():
                    self.held.set()
                    self.release.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def wait_port(host: str, port: int, timeout_s: float = 10.0) -> None:
    """Block until something accepts connections on ``host:port``."""

    def accepts() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    if not poll_until(accepts, timeout_s, poll_s=0.05):
        with socket.create_connection((host, port), timeout=0.5):  # its OSError says why
            return


def proxy_for_postgres(url: str, listen_host: str = "127.0.0.1") -> tuple[TcpProxy, str]:
    """A started proxy in front of the PostgreSQL of ``url`` and the URL through it.

    The server may listen on TCP or, as the embedded one does, only on a Unix
    socket (``?host=/socket/dir``); clients reach the proxy over TCP either way,
    on ``listen_host`` (another address than loopback: e.g. for network namespaces).
    """
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    socket_dir = parsed.query.get("host")
    if isinstance(socket_dir, tuple):
        socket_dir = socket_dir[0]
    if socket_dir:
        (path,) = [p for p in Path(socket_dir).glob(".s.PGSQL.*") if p.suffix != ".lock"]
        proxy = TcpProxy("", 0, upstream_unix=str(path), listen_host=listen_host)
    else:
        proxy = TcpProxy(parsed.host or "127.0.0.1", parsed.port or 5432, listen_host=listen_host)
    proxy.start()
    query = {k: v for k, v in parsed.query.items() if k != "host"}
    through = parsed.set(host=listen_host, port=proxy.port, query=query)
    return proxy, through.render_as_string(hide_password=False)
