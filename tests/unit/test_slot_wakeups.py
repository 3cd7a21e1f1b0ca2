"""The wake-up of packs waiting for a slot (app/limits/slot_wakeups.py): a pack that
frees a model's slots wakes as many packs waiting for that model's, not those of
another model; in this process at once, in another through its announcement."""

from __future__ import annotations

import threading

from batchgen.limits.slot_wakeups import SlotWakeups


def _waiter(freed: SlotWakeups, model: str) -> threading.Thread:
    thread = threading.Thread(target=freed.wait, args=(model, 60.0), daemon=True)
    thread.start()
    return thread


def _waiting(freed: SlotWakeups, model: str, n: int) -> None:
    """Until ``n`` threads wait for ``model``'s slots."""
    for _ in range(10_000):
        if freed.waiters(model) == n:
            return
        threading.Event().wait(0.001)
    raise AssertionError(f"{n} waiters on {model} never came")


def test_freeing_slots_wakes_as_many_waiting_packs_of_that_model():
    freed = SlotWakeups()
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
    freed = SlotWakeups()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (freed.wait("a", 0.01), done.set()), daemon=True)
    thread.start()
    assert done.wait(30)


def test_another_processs_announcement_wakes_as_many_waiting_packs_here():
    here, there = SlotWakeups(), SlotWakeups()
    waiting = [_waiter(here, "a") for _ in range(3)]
    _waiting(here, "a", 3)
    command, _, message = there.announcement("a", 2)
    assert command == "PUBLISH"
    here.heard(message.encode())
    _waiting(here, "a", 1)
    # Its own announcement (its waiters were woken already) and one it cannot read: none.
    here.heard(here.announcement("a", 5)[2])
    for unreadable in (b"", b"two x a", b"2", "1 x"):
        here.heard(unreadable)
    for thread in waiting:
        thread.join(timeout=0.05)
    assert sum(t.is_alive() for t in waiting) == 1
    here.freed("a", 1)
    for thread in waiting:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in waiting)


def test_a_count_that_is_not_ascii_digits_is_ignored():
    here = SlotWakeups()
    waiting = _waiter(here, "a")
    _waiting(here, "a", 1)
    here.heard("² x a")  # str.isdigit() holds, int() does not
    waiting.join(timeout=0.05)
    assert waiting.is_alive()
    here.freed("a", 1)
    waiting.join(timeout=30)
    assert not waiting.is_alive()
