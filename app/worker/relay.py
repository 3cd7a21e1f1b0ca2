"""A streamed call's chunks, from the thread that makes its provider call to the thread
that answers its caller, both in the API process.

The provider adapter hands over each chunk as soon as it has read it
(:attr:`batchgen.providers.base.ProviderRequest.on_chunk`); the call's runner marks
the end of each attempt with its verdict (:meth:`ChunkRelay.ended`), after the
attempt's result was recorded. The reader takes them in that order
(:meth:`ChunkRelay.take`). An item's end heard from PostgreSQL wakes the reader too
(:class:`Wake`): a call that a worker ran instead has no chunks here, only its end.

Nothing here is kept or sent anywhere else: a chunk lives until the reader has
written it to the caller.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, NamedTuple


class End(NamedTuple):
    """An attempt of the call ended here with this verdict outcome (``"succeeded"``,
    ``"retry"``...), or ``None``: this process runs the call no more."""

    outcome: str | None


# Taken when the item's end was heard (or a poll is due): the reader looks it up.
WOKEN = object()


class ChunkRelay:
    """One call's chunks and attempt ends, in order; thread-safe, unbounded (a stream
    is bounded by its ``max_tokens``)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.produced = 0  # chunks handed over so far (any attempt)

    def chunk(self, data: dict[str, Any]) -> None:
        """A provider chunk (an OpenAI ``chat.completion.chunk`` or an Anthropic
        event, as read): the adapter calls this as each one arrives."""
        self.produced += 1
        self._queue.put(data)

    def ended(self, outcome: str | None) -> None:
        """An attempt ended (after its outcome was recorded), or the runner stopped."""
        self._queue.put(End(outcome))

    def poke(self) -> None:
        """Wake the reader (the item's end was heard from PostgreSQL)."""
        self._queue.put(WOKEN)

    def take(self, timeout_s: float) -> dict[str, Any] | End | object | None:
        """The next chunk, :class:`End` or :data:`WOKEN`; None after ``timeout_s``."""
        try:
            return self._queue.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None


class Wake(threading.Event):
    """The event a call's end sets (:class:`batchgen.store.call_rows.CallWaiter`), which
    also wakes the relay's reader."""

    def __init__(self, relay: ChunkRelay) -> None:
        super().__init__()
        self._relay = relay

    def set(self) -> None:
        super().set()
        self._relay.poke()
