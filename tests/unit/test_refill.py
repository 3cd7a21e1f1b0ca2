"""The per-process refill: many freed places, few releases."""

from __future__ import annotations

import threading
import time

from batchgen.worker.refill import Refiller


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_notes_from_many_threads_are_released_together():
    calls: list[frozenset[str]] = []
    refiller = Refiller(lambda models: calls.append(models) or 0, coalesce_s=0.2)
    threads = [threading.Thread(target=refiller.note, args=(f"m{i % 3}",)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _wait_for(lambda: calls)
    time.sleep(0.3)  # no second release follows without a new note
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
