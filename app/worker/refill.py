"""Refilling a model's dispatch window after its items end, coalesced per process.

Every item that leaves its model's window (it ended, or went back to pending)
leaves room for another. Releasing after each one would cost a dispatch
transaction per item; instead the worker threads note the model, and one
thread of the process releases for every noted model at most every
``coalesce_s`` (a fifth of a second by default, while the window
holds ``dispatch_ahead_factor`` times the model's concurrency). A refill that
is lost (the process dies) only waits for the beat's dispatch tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Refiller:
    """Gathers the models to refill and releases them from one background thread."""

    def __init__(self, release: Callable[[frozenset[str]], int], coalesce_s: float) -> None:
        self._release = release
        self._coalesce_s = coalesce_s
        self._wanted: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0  # releases made (for tests and the bench)

    def note(self, model: str) -> None:
        """A place in ``model``'s window freed: refill it soon."""
        with self._lock:
            self._wanted.add(model)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="batchgen-refill", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def _take(self) -> frozenset[str]:
        with self._lock:
            models = frozenset(self._wanted)
            self._wanted.clear()
            self._wake.clear()
        return models

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(self._coalesce_s)  # let the other threads' notes gather
            models = self._take()
            if not models:
                continue
            try:
                self._release(models)
                self.rounds += 1
            except Exception as exc:  # the beat's tick releases it anyway
                log.warning("refill of %s failed (%s)", sorted(models), type(exc).__name__)
