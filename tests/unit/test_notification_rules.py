"""The pure parts of batch-finished notifications (app/domain/notifications.py)."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from batchgen.domain.notifications import (
    GIVE_UP_AFTER_S,
    body_bytes,
    check_callback,
    check_task_name,
    check_webhook_url,
    gives_up,
    payload,
    retry_delay_s,
    signature,
    signed_headers,
    verify,
)
from batchgen.errors import ValidationFailed

KEY = b"0123456789abcdef0123456789abcdef"
SECRET = "whsec_" + base64.b64encode(KEY).decode()


def test_a_signature_follows_standard_webhooks_and_verifies_only_its_body_recently():
    body = body_bytes(payload("batch_1", "completed", {"total": 2, "succeeded": 2}, 1_800_000_000))
    headers = signed_headers(SECRET, "42", 1_800_000_000, body)
    # The spec: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}"> keyed with the
    # base64-decoded part of the whsec_ secret.
    mac = hmac.new(KEY, b"42.1800000000." + body, hashlib.sha256).digest()
    assert headers == {
        "webhook-id": "42",
        "webhook-timestamp": "1800000000",
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
    }
    assert verify(SECRET, headers, body, now_s=1_800_000_100)
    assert not verify(SECRET, headers, body, now_s=1_800_000_301)  # replayed later
    other = "whsec_" + base64.b64encode(b"x" * 32).decode()
    assert not verify(other, headers, body, now_s=1_800_000_000)
    assert not verify(SECRET, headers, body + b" ", now_s=1_800_000_000)
    assert not verify(SECRET, {**headers, "webhook-id": "43"}, body, now_s=1_800_000_000)
    assert not verify(SECRET, {**headers, "webhook-signature": "v1,abc"}, body, 1_800_000_000)
    assert not verify(SECRET, {**headers, "webhook-timestamp": "x"}, body, 1_800_000_000)
    rotated = {**headers, "webhook-signature": "v1,old " + headers["webhook-signature"]}
    assert verify(SECRET, rotated, body, now_s=1_800_000_000)  # one of several signatures


def test_secrets_of_hex_digits_from_before_still_sign():
    old = "whsec_" + "ab" * 32  # what tenants were given before: base64 too
    assert signature(old, "1", 1, b"{}").startswith("v1,")


def test_callbacks_only_name_allowed_tasks_and_queues():
    allowed = (["hostapp.batch_done"], ["celery", "host.callbacks"], "celery")
    check_callback("hostapp.batch_done", None, *allowed)
    check_callback("hostapp.batch_done", "host.callbacks", *allowed)
    check_callback(None, None, [], ["celery"], "celery")
    with pytest.raises(ValidationFailed, match="BATCHGEN_CALLBACK_TASKS") as none_allowed:
        check_callback("hostapp.batch_done", None, [], ["celery"], "celery")
    assert none_allowed.value.status_code == 400
    for task in ("hostproj.tasks.delete_account", "batchgen.generate", "batchgen.nightly"):
        with pytest.raises(ValidationFailed, match=f"on_finished '{task}' is not one of"):
            check_callback(task, None, *allowed)
    with pytest.raises(ValidationFailed, match="on_finished_queue 'brand.new' is not one of"):
        check_callback("hostapp.batch_done", "brand.new", *allowed)
    with pytest.raises(ValidationFailed, match="on_finished_queue 'celery'"):
        check_callback("hostapp.batch_done", None, ["hostapp.batch_done"], ["x"], "celery")


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
