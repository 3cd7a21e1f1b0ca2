"""The pure parts of batch-finished notifications (app/domain/notifications.py)."""

from __future__ import annotations

import pytest

from batchgen.domain.notifications import (
    GIVE_UP_AFTER_S,
    body_bytes,
    check_task_name,
    check_webhook_url,
    gives_up,
    payload,
    retry_delay_s,
    signature,
    verify,
)
from batchgen.errors import ValidationFailed

SECRET = "whsec_test"


def test_a_signature_verifies_only_its_body_recently():
    body = body_bytes(payload("batch_1", "completed", {"total": 2, "succeeded": 2}, 1_800_000_000))
    header = signature(SECRET, 1_800_000_000, body)
    assert header.startswith("t=1800000000,v1=") and len(header.split("v1=")[1]) == 64
    assert verify(SECRET, header, body, now_s=1_800_000_100)
    assert not verify(SECRET, header, body, now_s=1_800_000_301)  # replayed later
    assert not verify("whsec_other", header, body, now_s=1_800_000_000)
    assert not verify(SECRET, header, body + b" ", now_s=1_800_000_000)
    assert not verify(SECRET, "v1=abc", body, now_s=1_800_000_000)
    assert not verify(SECRET, "t=x,v1=abc", body, now_s=1_800_000_000)


def test_the_body_is_canonical_json_of_ids_and_counts():
    data = payload("batch_1", "cancelled", {"total": 1, "cancelled": 1}, None)
    assert body_bytes(data) == (
        b'{"batch_id":"batch_1","finished_at":null,"request_counts":{"cancelled":1,"total":1},'
        b'"status":"cancelled","type":"batch.finished"}'
    )


def test_retries_double_to_an_hour_and_give_up_after_a_day():
    assert [retry_delay_s(n) for n in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert retry_delay_s(20) == 3600 and retry_delay_s(1, first_s=0.5) == 0.5
    assert not gives_up(GIVE_UP_AFTER_S - 1) and gives_up(GIVE_UP_AFTER_S)


@pytest.mark.parametrize("url", ["ftp://x/y", "http://", "hooks.example.com/x", "h" * 2001])
def test_bad_webhook_urls_are_refused_by_name(url):
    with pytest.raises(ValidationFailed, match="webhook_url must be"):
        check_webhook_url(url)


def test_good_targets_pass_and_empty_ones_mean_none():
    assert check_webhook_url("https://hooks.example.com/x?y=1") == "https://hooks.example.com/x?y=1"
    assert check_webhook_url("") is None and check_task_name(None) is None
    assert check_task_name("myproj.tasks.batch_done") == "myproj.tasks.batch_done"
    with pytest.raises(ValidationFailed, match="on_finished must be a Celery task name"):
        check_task_name("myproj.tasks.batch-done")
