"""Pure parts of the API's hardening (issue 10): bounded token counting, batch status,
the idempotency fingerprint, the 503 classification, settings repr and access logs."""

from __future__ import annotations

import json
import logging

import pytest

from batchgen.domain.formats import tokens
from batchgen.domain.formats.admission import Limits, RequestFingerprint, parse_lines, validate_line
from batchgen.domain.lifecycle.status import BatchStatus, ItemStatus, batch_status
from batchgen.errors import PayloadTooLarge, ValidationFailed
from batchgen.registry import get_registry


def _line(text: str, custom_id: str = "a", max_tokens: int = 100) -> bytes:
    body = {
        "model": "sim-small",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }
    row = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(row).encode() + b"\n"


def test_oversized_line_is_refused_before_tokenizing(monkeypatch):
    """Case 19: a line whose bytes alone prove it cannot fit is never tokenized."""

    def no_tokenizing(*args: object, **kwargs: object) -> int:
        raise AssertionError("tokenized a line its size already rules out")

    monkeypatch.setattr(tokens, "count_messages", no_tokenizing)
    spec = get_registry()["sim-small"]
    text = "word " * (spec.context_window * tokens.max_token_bytes(spec.encoding) // 5 + 10)
    with pytest.raises(ValidationFailed, match="context window") as info:
        validate_line(_line(text), 1, get_registry())
    assert info.value.field == "body.messages"


class _Spy:
    """Wraps an encoding, adding up the characters it was asked to encode."""

    def __init__(self, enc: object) -> None:
        self.enc = enc
        self.chars = 0

    def encode(self, text: str, **kwargs: object) -> list[int]:
        self.chars += len(text)
        return self.enc.encode(text, **kwargs)  # type: ignore[attr-defined,no-any-return]


def test_counting_stops_once_a_prompt_is_past_the_context_window(monkeypatch):
    """Case 19: a prompt under the byte floor but over the window is counted only
    until it is known not to fit."""
    spy = _Spy(tokens.get_encoding("cl100k_base"))
    monkeypatch.setattr(tokens, "get_encoding", lambda name: spy)
    text = "word " * 300_000  # 1.5 MB: 300 000 tokens, under the floor of 16 384 x 128 bytes
    with pytest.raises(ValidationFailed, match="context window"):
        validate_line(_line(text), 1, get_registry())
    assert 0 < spy.chars < len(text) // 5


def test_tokenizing_work_per_request_is_bounded():
    """Case 19: one request hands the tokenizer at most max_tokenize_bytes of text."""
    lines = [_line("x " * 1500, custom_id=f"c{i}") for i in range(10)]  # 3 000 bytes each
    limits = Limits(max_lines=100, max_bytes=1 << 20, max_tokenize_bytes=10_000)
    with pytest.raises(PayloadTooLarge, match="split it") as info:
        list(parse_lines(iter(lines), get_registry(), limits))
    assert info.value.line == 4
    assert len(list(parse_lines(iter(lines[:3]), get_registry(), limits))) == 3


def test_bounded_count_is_exact_on_long_texts():
    """Counting long texts in pieces cut at word boundaries gives tiktoken's exact count."""
    enc = tokens.get_encoding("cl100k_base")
    assert enc is not None
    text = " ".join(f"naïve-{i} 漢字, it's  {i * 7919}!\n" for i in range(20_000))
    assert len(text) > 4 * tokens.CHUNK_CHARS
    assert tokens.count_text(text, "cl100k_base") == len(enc.encode(text))


def test_batch_whose_items_all_expired_is_expired():
    """Case 18, the pure rule."""
    assert batch_status({ItemStatus.EXPIRED: 3}, False) is BatchStatus.EXPIRED
    assert batch_status({ItemStatus.EXPIRED: 2, ItemStatus.SUCCEEDED: 1}, False) is (
        BatchStatus.COMPLETED
    )
    assert batch_status({ItemStatus.EXPIRED: 2, ItemStatus.SUCCEEDED: 0}, False) is (
        BatchStatus.EXPIRED
    )
    assert batch_status({ItemStatus.EXPIRED: 3}, True) is BatchStatus.CANCELLED


def test_request_fingerprint_ignores_spelling_not_content():
    """Case 15: the same request spelled differently matches; any change does not."""

    def digest(params: dict, *bodies: bytes) -> str:
        fp = RequestFingerprint(params)
        limits = Limits(max_lines=10, max_bytes=1 << 20)
        for _ in fp.track(parse_lines(iter(bodies), get_registry(), limits)):
            pass
        return fp.hexdigest()

    params = {"completion_window_s": 60.0, "priority": "bulk", "metadata": {"a": 1, "b": 2}}
    line = _line("hi")
    respelled = json.dumps(json.loads(line), indent=1).replace("\n", "").encode() + b"\r\n"
    base = digest(params, line)
    assert digest(dict(reversed(list(params.items()))), b"\n", respelled) == base
    assert digest(params, _line("hi!")) != base
    assert digest({**params, "priority": "interactive"}, line) != base
    assert digest(params, line, _line("hi", custom_id="b")) != base


def test_unreachable_services_are_503_with_retry_after():
    """Case 24, the pure classification."""
    import redis
    from sqlalchemy import exc as sa_exc

    from batchgen.api import unavailable

    db_down = sa_exc.OperationalError("SELECT 1", {}, Exception("connection refused"))
    assert unavailable(db_down, 5.0).code == "database_unavailable"  # type: ignore[union-attr]
    no_connection = sa_exc.TimeoutError("QueuePool limit of size 10 overflow 20 reached")
    assert unavailable(no_connection, 5.0).retry_after_s == 5.0  # type: ignore[union-attr]
    redis_down = redis.ConnectionError("Error 111 connecting")
    assert unavailable(redis_down, 5.0).code == "redis_unavailable"  # type: ignore[union-attr]
    assert unavailable(RuntimeError("bug"), 5.0) is None


def test_settings_repr_shows_no_password(monkeypatch):
    """Case 28: repr() and str() of the settings mask secrets and URL passwords."""
    from batchgen.config import Settings

    secrets = ["pg-s3cret", "redis-hunter2", "amqp-pw9", "metrics-tok-77", "flower-pw-88"]
    settings = Settings(
        database_url=f"postgresql://app:{secrets[0]}@db:5432/batchgen",
        redis_url=f"redis://:{secrets[1]}@cache:6379/0",
        celery_broker_url=f"amqp://guest:{secrets[2]}@mq//",
        metrics_token=secrets[3],
        flower_password=secrets[4],
    )
    for shown in (repr(settings), str(settings)):
        assert not any(s in shown for s in secrets), shown
        assert "postgresql://app:***@db:5432/batchgen" in shown
    assert settings.database.url.endswith(f"{secrets[0]}@db:5432/batchgen")  # still usable


def test_access_log_records_of_every_server_lose_the_query_string():
    """Case 28: werkzeug, gunicorn and Django's runserver records keep the path only."""
    from batchgen.logs import AccessLogRedactor

    redactor = AccessLogRedactor()
    secret = "metadata=%7B%22deal%22%3A%22Initech%22%7D"
    werkzeug = logging.LogRecord(
        "werkzeug",
        20,
        "f",
        1,
        '"%s" %s %s',
        (f"POST /v1/batches?{secret} HTTP/1.1", 200, "-"),
        None,
    )
    gunicorn = logging.LogRecord(
        "gunicorn.access",
        20,
        "f",
        1,
        '%(h)s "%(r)s" %(s)s %(q)s',
        ({"h": "1.2.3.4", "r": f"POST /v1/batches?{secret} HTTP/1.1", "s": "200", "q": secret},),
        None,
    )
    django = logging.LogRecord(
        "django.server", 20, "f", 1, '"%s" %s %s', (f"GET /x?{secret} HTTP/1.1", 200, 5), None
    )
    for record in (werkzeug, gunicorn, django):
        assert redactor.filter(record)
        message = record.getMessage()
        assert "Initech" not in message and "metadata" not in message, message
        assert "HTTP/1.1" in message


def _capped_app():
    from flask import Flask

    from batchgen.bodies import body_lines, json_body

    app = Flask("capped")
    app.register_error_handler(PayloadTooLarge, lambda exc: (exc.message, 413))
    app.add_url_rule("/lines", "lines", lambda: {"n": len(list(body_lines(10)))}, methods=["POST"])
    app.add_url_rule("/json", "json", lambda: {"v": json_body(10)}, methods=["POST"])
    return app.test_client()


@pytest.mark.parametrize("path", ["/lines", "/json"])
def test_a_streamed_body_of_its_cap_is_read_and_one_byte_more_is_413(path):
    """Issue 27 item 2: a body with no Content-Length is counted while it streams."""
    import io

    client = _capped_app()
    streamed = {"wsgi.input_terminated": True}  # what a server sets for a chunked body
    for body, status in ((b'"12345678"', 200), (b'"123456789"', 413), (b"1" * 10**6, 413)):
        res = client.post(
            path,
            input_stream=io.BytesIO(body),
            environ_overrides=streamed,
            content_type="application/json",
        )
        assert res.status_code == status, (body[:20], res.text)
        if status == 413:
            assert res.text == "body larger than 10 bytes"
    res = client.post(path, data=b"1" * 11, content_type="application/json")  # declared
    assert res.status_code == 413


def test_file_quota_decisions():
    """Issue 27 item 5, the pure part: count, bytes, a file alone too big, Retry-After."""
    from batchgen.domain.submission import check_file_quota
    from batchgen.errors import FileQuotaExceeded

    quota = (3, 1000)
    check_file_quota("t", 100, (2, 900), quota, 50.0)  # fits: the third file, 1000 bytes
    with pytest.raises(FileQuotaExceeded, match="keeps 3 files") as by_count:
        check_file_quota("t", 1, (3, 10), quota, 50.0)
    assert by_count.value.retry_after_s == 50.0
    with pytest.raises(FileQuotaExceeded, match="bytes of files") as by_bytes:
        check_file_quota("t", 101, (2, 900), quota, None)
    assert by_bytes.value.retry_after_s >= 1.0
    with pytest.raises(PayloadTooLarge, match="file quota"):
        check_file_quota("t", 1001, (0, 0), quota, None)
