"""Pure pieces of the worker's fixes: one clock for deadlines, per-model attempt caps."""

from __future__ import annotations

import datetime as dt

from batchgen.config import Settings
from batchgen.domain.lifecycle.deadlines import call_timeout_s, carried_forward
from batchgen.registry import parse_registry
from batchgen.worker.sweep import attempt_caps

T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


def test_database_clock_is_carried_forward_by_monotonic_time():
    assert carried_forward(T0, 100.0, 112.5) == T0 + dt.timedelta(seconds=12.5)
    assert carried_forward(T0, 100.0, 99.0) == T0  # never backwards


def test_call_timeout_is_the_time_left_on_the_database_clock():
    deadline = T0 + dt.timedelta(seconds=30)
    now = carried_forward(T0, 0.0, 10.0)
    assert call_timeout_s(120.0, deadline, now) == 20.0
    assert call_timeout_s(5.0, deadline, now) == 5.0
    assert call_timeout_s(120.0, deadline, carried_forward(T0, 0.0, 31.0)) == 0.0


def test_attempt_caps_take_the_smaller_of_model_and_global():
    registry = parse_registry(
        """
[models."a"]
provider = "openai"
base_url = "http://x/v1"
api_key_env = "K"
group = "g"
budget_key = "a"
context_window = 1000
max_output_tokens = 100
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 1
input_usd_per_1m = 0
output_usd_per_1m = 0
max_attempts = 2

[models."b"]
provider = "openai"
base_url = "http://x/v1"
api_key_env = "K"
group = "g"
budget_key = "b"
context_window = 1000
max_output_tokens = 100
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 1
input_usd_per_1m = 0
output_usd_per_1m = 0
max_attempts = 9
"""
    )
    assert attempt_caps(registry, Settings(max_attempts=4)) == {"a": 2, "b": 4}
