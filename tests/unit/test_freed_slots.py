"""The wake-up of packs waiting for a slot (app/worker/pack_calls.py, _FreedSlots): a
pack of the process that frees a model's slots wakes as many packs waiting for that
model's, not those of another model."""

from __future__ import annotations

import threading

from batchgen.worker.pack_calls import _FreedSlots


def _waiter(freed: _FreedSlots, model: str) -> threading.Thread:
    thread = threading.Thread(target=freed.wait, args=(model, 60.0), daemon=True)
    thread.start()
    return thread


def _waiting(freed: _FreedSlots, model: str, n: int) -> None:
    """Until ``n`` threads wait on ``model``'s condition (its waiters list)."""
    condition = freed._of(model)
    for _ in range(10_000):
        with condition:
            if len(condition._waiters) == n:  # type: ignore[attr-defined]
                return
        threading.Event().wait(0.001)
    raise AssertionError(f"{n} waiters on {model} never came")


def test_freeing_slots_wakes_as_many_waiting_packs_of_that_model():
    freed = _FreedSlots()
    a = [_waiter(freed, "a") for _ in range(3)]
    b = _waiter(freed, "b")
    _waiting(freed, "a", 3)
    _waiting(freed, "b", 1)

    freed.freed("a", 2)  # two slots: two of the three waiters wake
    _waiting(freed, "a", 1)
    for thread in a:
        thread.join(timeout=0.05)
    assert sum(t.is_alive() for t in a) == 1
    assert b.is_alive()  # another model's slots: still waiting

    freed.freed("b", 1)
    b.join(timeout=30)
    assert not b.is_alive()
    freed.freed("a", 5)  # more slots than waiters: the last one wakes, nothing else
    for thread in a:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in a)


def test_a_wait_ends_at_its_timeout_without_a_slot_freed():
    freed = _FreedSlots()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (freed.wait("a", 0.01), done.set()), daemon=True)
    thread.start()
    assert done.wait(30)
