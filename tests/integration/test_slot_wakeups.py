"""Packs waiting for a model's slots in one process are woken by the pipeline that frees
slots in another (app/limits/slot_wakeups.py): its announcement travels through Redis
to the waiting process's listener."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from batchgen.limits.backend import get_redis, scripts_at_once
from batchgen.limits.slot_wakeups import SlotWakeups
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def test_a_pipeline_that_frees_slots_wakes_the_packs_waiting_in_another_process(services):
    client = get_redis()
    model = f"wake-{uuid.uuid4().hex[:8]}"  # no other test's announcements wake it
    here, there = SlotWakeups(), SlotWakeups()  # two processes' own
    woken = threading.Event()
    waiter = threading.Thread(
        target=lambda: (here.wait(model, 600.0, client), woken.set()), daemon=True
    )
    waiter.start()

    def announced() -> bool:
        """Free one slot there (its announcement after a script, in one pipeline) until
        the listener here, subscribing meanwhile, has heard one."""
        lock = f"bg:test-wake:{model}"
        (reply,) = scripts_at_once(
            client, "beat_unlock", [([lock], ["token"])], then=[there.announcement(model, 1)]
        )
        assert reply == 0  # the script's own reply, the announcement's left out
        return woken.wait(0.05)

    wait_until(announced, 60, "the waiting pack woken by another process's pipeline")
    # Another model's announcement wakes nothing of this one.
    second = threading.Event()
    threading.Thread(
        target=lambda: (here.wait(model, 600.0, client), second.set()), daemon=True
    ).start()

    def waits() -> bool:
        return here.waiters(model) == 1

    wait_until(waits, 30, "the second pack waiting")
    client.execute_command(*there.announcement(f"{model}-other", 5))
    assert not second.wait(0.3)
    here.freed(model, 1)
    assert second.wait(30)


def test_a_pipelines_scripts_stand_whatever_the_commands_after_them_answer(tmp_path):
    """The announcement rides after the settle scripts, best effort: a command Redis
    refuses there (a user without the right to PUBLISH, say) fails nothing. A script
    Redis does not know is loaded and the pipeline sent again; a script's own error
    is raised."""
    from tests.integration.test_faults_redis import OwnRedis

    own = OwnRedis(tmp_path / "own-redis")
    own.start()
    try:
        r = own.client()
        lock = "bg:test-lock"
        r.set(lock, "token")
        r.script_flush()  # NOSCRIPT for the first try
        replies = scripts_at_once(
            r,
            "beat_unlock",
            [([lock], ["not ours"]), ([lock], ["token"])],
            then=[("NO-SUCH-COMMAND",)],
        )
        assert replies == [0, 1] and not r.exists(lock)
        with pytest.raises(redis.ResponseError):
            scripts_at_once(r, "beat_unlock", [([], ["no key"])], then=[("PING",)])
    finally:
        own.server.stop()
