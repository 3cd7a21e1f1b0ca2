"""Refilling a model's dispatch window after its items end, coalesced per process.

Every item that leaves its model's window (it ended, or went back to pending)
leaves room for another. Releasing after each one would cost a dispatch
transaction per item; instead the worker threads note the model, and one
thread of the process releases for every noted model at most every
``coalesce_s`` (a fifth of a second by default, while the window
holds ``dispatch_ahead_factor`` times the model's concurrency), or at once when
a model has had ``enough(model)`` places freed meanwhile
(:func:`batchgen.domain.lifecycle.decisions.refill_at_once_after`): with calls shorter
than the wait, the window's reserve would run out first, and the wait alone
would hold the model to about one window per wait. A refill that is lost (the
process dies) only waits for the beat's dispatch tick.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Refiller:
    """Gathers the models to refill and releases them from one background thread."""

    def __init__(
        self,
        release: Callable[[frozenset[str]], int],
        coalesce_s: float,
        enough: Callable[[str], int] | None = None,
    ) -> None:
        self._release = release
        self._coalesce_s = coalesce_s
        self._enough_for = enough
        self._wanted: dict[str, int] = {}  # model -> places freed since the last release
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._enough = threading.Event()  # a model has had enough places freed: release now
        self._thread: threading.Thread | None = None
        self.rounds = 0  # releases made (for tests and the bench)

    def note(self, model: str) -> None:
        """A place in ``model``'s window freed: refill it soon."""
        with self._lock:
            freed = self._wanted[model] = self._wanted.get(model, 0) + 1
            if self._enough_for is not None and freed >= self._enough_for(model):
                self._enough.set()
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
            self._enough.clear()
        return models

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._enough.wait(self._coalesce_s)  # let the other threads' notes gather
            models = self._take()
            if not models:
                continue
            try:
                self._release(models)
                self.rounds += 1
            except Exception as exc:  # the beat's tick releases it anyway
                log.warning("refill of %s failed (%s)", sorted(models), type(exc).__name__)
