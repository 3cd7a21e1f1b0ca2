"""The per-process refill: many freed places, few releases."""

from __future__ import annotations

import threading
import time

from batchgen.worker.refill import Refiller
from tests.waiting import hold, wait_until


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    wait_until(condition, timeout_s, "the refiller's release", poll_s=0.005)


def test_notes_from_many_threads_are_released_together():
    calls: list[frozenset[str]] = []
    refiller = Refiller(lambda models: calls.append(models) or 0, coalesce_s=0.2)
    threads = [threading.Thread(target=refiller.note, args=(f"m{i % 3}",)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _wait_for(lambda: calls)
    hold(0.3, "no second release follows without a new note")
    assert calls == [frozenset({"m0", "m1", "m2"})]


def test_a_note_after_a_release_is_released_again():
    calls: list[frozenset[str]] = []
    refiller = Refiller(lambda models: calls.append(models) or 0, coalesce_s=0.01)
    refiller.note("a")
    _wait_for(lambda: len(calls) == 1)
    refiller.note("b")
    _wait_for(lambda: len(calls) == 2)
    assert calls == [frozenset({"a"}), frozenset({"b"})]


def test_a_failing_release_does_not_stop_the_refills():
    calls: list[frozenset[str]] = []

    def release(models: frozenset[str]) -> int:
        calls.append(models)
        if len(calls) == 1:
            raise ConnectionError("database away")
        return 1

    refiller = Refiller(release, coalesce_s=0.01)
    refiller.note("a")
    _wait_for(lambda: len(calls) == 1)
    refiller.note("a")
    _wait_for(lambda: refiller.rounds == 1)
    assert len(calls) == 2


def test_a_model_with_enough_places_freed_is_released_at_once():
    """Calls shorter than the coalescing wait would use the window's reserve up before
    the wait ends: past ``enough`` freed places the model is released without waiting."""
    calls: list[tuple[float, frozenset[str]]] = []
    refiller = Refiller(
        lambda models: calls.append((time.monotonic(), models)) or 0,
        coalesce_s=30.0,
        enough=lambda model: 3,
    )
    refiller.note("a")
    refiller.note("b")
    refiller.note("a")
    hold(0.2, "two of three: no release, the wait goes on")
    assert calls == []
    noted_at = time.monotonic()
    refiller.note("a")
    _wait_for(lambda: calls)
    assert calls[0][1] == frozenset({"a", "b"})  # every noted model goes in the release
    assert calls[0][0] - noted_at < 5.0  # not the 30 s wait
    refiller.note("a")  # the count starts again after a release
    hold(0.2, "one of three after the release: no release")
    assert len(calls) == 1


def test_refill_at_once_after_half_the_reserve():
    from batchgen.domain.lifecycle.decisions import refill_at_once_after

    assert refill_at_once_after(32, 2.0) == 16  # window 64: 32 queued ahead, half of it
    assert refill_at_once_after(8, 2.0) == 4
    assert refill_at_once_after(10, 1.5) == 3  # window 15: 5 ahead, rounded up
    assert refill_at_once_after(4, 1.0) == 1  # no reserve: every freed place
    assert refill_at_once_after(1, 1.2) == 1
