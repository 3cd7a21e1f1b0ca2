"""The pure rules of offloading (app/domain/scheduling/offload.py) and the registry's offline
route."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest

from batchgen.domain.lifecycle.status import TRANSITIONS, ItemStatus, Priority
from batchgen.domain.scheduling.offload import (
    JobBounds,
    OfflineWindow,
    OffloadMode,
    Row,
    cutoff_at,
    keeps_offline,
    online_time_s,
    parse_offload,
    plan_jobs,
    poll_delay_s,
    saved_usd,
    wants_offline,
)
from batchgen.errors import ConfigError, ValidationFailed
from batchgen.registry import parse_registry

WINDOW = OfflineWindow(turnaround_s=3600, fallback_s=600)
BASE = """
[models."m"]
provider = "openai"
base_url = "http://x/v1"
api_key_env = "K"
group = "g"
budget_key = "k"
context_window = 8192
max_output_tokens = 512
tokens_per_min = 60000
requests_per_min = 100
max_concurrency = 4
input_usd_per_1m = 1.0
output_usd_per_1m = 4.0
"""


@pytest.mark.parametrize(
    ("mode", "priority", "left_s", "offline"),
    [
        (OffloadMode.AUTO, Priority.BULK, 4200, True),  # exactly turnaround + fallback
        (OffloadMode.AUTO, Priority.BULK, 4199, False),
        (OffloadMode.AUTO, Priority.INTERACTIVE, 86400, False),
        (OffloadMode.AUTO, Priority.CALL, 86400, False),
        (OffloadMode.NEVER, Priority.BULK, 86400, False),
        (OffloadMode.ALWAYS, Priority.INTERACTIVE, 601, True),
        (OffloadMode.ALWAYS, Priority.BULK, 600, False),  # nothing left after the fallback
        (OffloadMode.ALWAYS, Priority.CALL, 86400, False),
    ],
)
def test_the_submit_rule(mode, priority, left_s, offline):
    assert (
        wants_offline(mode=mode, priority=priority, window=WINDOW, deadline_left_s=left_s)
        is offline
    )


def test_a_model_without_an_offline_route_never_offloads():
    for mode in OffloadMode:
        assert not wants_offline(
            mode=mode, priority=Priority.BULK, window=None, deadline_left_s=1e9
        )


def test_the_online_time_needed_grows_with_the_job():
    # 60 000 tokens/min: 120 000 tokens drain in 120 s, beside the 600 s kept back.
    assert online_time_s(120_000, 60_000, 600) == 720
    assert keeps_offline(mode=OffloadMode.AUTO, window=WINDOW, deadline_left_s=4320, online_s=720)
    assert not keeps_offline(
        mode=OffloadMode.AUTO, window=WINDOW, deadline_left_s=4319, online_s=720
    )
    assert keeps_offline(mode=OffloadMode.ALWAYS, window=WINDOW, deadline_left_s=721, online_s=720)
    deadline = dt.datetime(2026, 12, 1, 6, tzinfo=dt.UTC)
    assert cutoff_at(deadline, 720) == dt.datetime(2026, 12, 1, 5, 48, tzinfo=dt.UTC)


def test_jobs_respect_every_bound_and_keep_the_order():
    rows = [Row(i, tokens=100, size_bytes=10) for i in range(10)]
    jobs = plan_jobs(rows, JobBounds(max_requests=4, max_bytes=1000, free_tokens=None))
    assert [[r.item_id for r in job] for job in jobs] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    by_bytes = plan_jobs(rows, JobBounds(max_requests=100, max_bytes=25, free_tokens=None))
    assert [len(job) for job in by_bytes] == [2, 2, 2, 2, 2]
    # The enqueued-token room: 350 tokens take three rows; the rest wait, in order.
    limited = plan_jobs(rows, JobBounds(max_requests=2, max_bytes=1000, free_tokens=350))
    assert [[r.item_id for r in job] for job in limited] == [[0, 1], [2]]
    assert plan_jobs(rows, JobBounds(4, 1000, free_tokens=0)) == []


def test_a_row_larger_than_a_job_is_never_planned():
    rows = [Row(1, 10, 10), Row(2, 10, 5000), Row(3, 10, 10)]
    jobs = plan_jobs(rows, JobBounds(max_requests=10, max_bytes=100, free_tokens=None))
    assert [[r.item_id for r in job] for job in jobs] == [[1, 3]]


def test_polls_back_off_to_the_cap():
    assert [poll_delay_s(n, 30, 300) for n in range(6)] == [30, 60, 120, 240, 300, 300]
    assert poll_delay_s(10_000, 1, 5) == 5


def test_the_mode_is_parsed_precisely():
    assert parse_offload(None) is OffloadMode.AUTO
    assert parse_offload("never") is OffloadMode.NEVER
    with pytest.raises(ValidationFailed, match="offload must be one of auto, never, always"):
        parse_offload("half")


def test_an_offloaded_item_ends_answered_back_online_or_cancelled():
    assert TRANSITIONS[ItemStatus.OFFLOADED] == {
        ItemStatus.SUCCEEDED,
        ItemStatus.PENDING,
        ItemStatus.CANCELLED,
    }
    # Nothing moves an item into a provider job but its insertion: the route is
    # chosen when it is stored.
    assert not any(ItemStatus.OFFLOADED in targets for targets in TRANSITIONS.values())


def test_the_registry_route_defaults_to_half_the_online_prices():
    spec = parse_registry(BASE.replace('[models."m"]\n', '[models."m"]\noffload = true\n'))["m"]
    assert spec.offline_route is not None and spec.offline_route.turnaround_s == 3600
    batch = spec.offline_prices()
    assert (batch.input_usd_per_1m, batch.output_usd_per_1m) == (0.5, 2.0)
    assert saved_usd(Decimal("1.00"), Decimal("0.50")) == Decimal("0.50")
    priced = parse_registry(
        BASE + '[models."m".offline]\ninput_usd_per_1m = 0.4\nturnaround_s = 120\n'
    )["m"]
    assert priced.offline_route is None  # declared but not turned on
    assert priced.offline_prices().input_usd_per_1m == 0.4


def test_a_bad_offline_route_names_its_field():
    with pytest.raises(ConfigError, match=r"model 'm': offline\.turnaround_s"):
        parse_registry(BASE + '[models."m".offline]\nturnaround_s = -1\n')
    with pytest.raises(ConfigError, match=r"model 'm': offline\.max_jobs"):
        parse_registry(BASE + '[models."m".offline]\nmax_jobs = 3\n')


def test_a_remainder_under_the_providers_minimum_runs_online_or_waits():
    from batchgen.domain.scheduling.offload import JobBounds, Row, plan_jobs, too_few

    rows = [Row(i, 10, 100) for i in range(7)]
    jobs = plan_jobs(rows, JobBounds(3, 10_000, None))
    assert [len(j) for j in jobs] == [3, 3, 1]
    kept, small = too_few(jobs, 3, all_planned=True)
    assert [len(j) for j in kept] == [3, 3] and [r.item_id for r in small] == [6]
    # Rows held back by the token room: the small job waits with them.
    kept, small = too_few(jobs, 3, all_planned=False)
    assert [len(j) for j in kept] == [3, 3] and small == []
    assert too_few(jobs, 1, all_planned=True) == (jobs, [])
