"""A tiny TCP proxy a test can cut and restore: a server outage without stopping the server.

``cut()`` closes the listening socket and resets every open connection, so
clients see their connections die and new connects refused, exactly as when
the server's host goes away; ``restore()`` listens on the same port again.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
from types import TracebackType

BUFFER_BYTES = 65536


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.host = host
        self.port = 0
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by cut() or stop()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    _reset(client)
                    _reset(upstream)
                    return
                self._sockets.update((client, upstream))
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while True:
                readable, _, _ = select.select([a, b], [], [], 1.0)
                for sock in readable:
                    data = sock.recv(BUFFER_BYTES)
                    if not data:
                        return
                    peers[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._sockets.difference_update((a, b))
            for sock in (a, b):
                sock.close()

    def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            doomed = list(self._sockets)
            self._sockets.clear()
        if listener is not None:
            listener.close()
        for sock in doomed:
            _reset(sock)

    def restore(self) -> None:
        """Listen on the same port again."""
        if self._listener is None:
            self.start()

    stop = cut

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a vanished peer looks to the other side."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
