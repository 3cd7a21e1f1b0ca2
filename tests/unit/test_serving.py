"""``batchgen api``'s gunicorn settings (app/serving.py)."""

from __future__ import annotations

from batchgen.config import Settings
from batchgen.serving import gunicorn_options, pool_size_for


def test_the_api_runs_threaded_workers_with_a_thread_per_waiting_call():
    options = gunicorn_options(Settings(), "127.0.0.1", 8123, workers=3, threads=48)
    assert options["bind"] == "127.0.0.1:8123"
    assert options["worker_class"] == "gthread"  # hands the app its socket: hang-ups are seen
    assert (options["workers"], options["threads"]) == (3, 48)
    assert options["accesslog"] is None


def test_a_workers_pool_is_sized_for_its_threads():
    assert pool_size_for(64) == 8
    assert pool_size_for(65) == 9
    assert pool_size_for(1) == 4  # never below the floor
