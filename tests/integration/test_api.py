"""The HTTP API: bad input gets a precise 4xx and stores nothing; tenants are isolated."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select

from batchgen.api import create_app
from batchgen.config import get_settings
from batchgen.store import db
from batchgen.store.schema import Batch, Item
from tests.helpers import chat_line, jsonl, make_tenant

pytestmark = pytest.mark.integration


@pytest.fixture
def api(clean_db):
    return create_app().test_client()


@pytest.fixture
def key(clean_db):
    return make_tenant("acme")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _stored() -> tuple[int, int]:
    with db.session_scope() as s:
        return (
            s.scalar(select(func.count()).select_from(Batch)),
            s.scalar(select(func.count()).select_from(Item)),
        )


GOOD = json.dumps(chat_line("ok-1")).encode()


def _line(**changes):
    row = chat_line("x-1")
    body = changes.pop("body", None)
    if body is not None:
        row["body"].update(body)
    row.update(changes)
    return json.dumps(row).encode()


BAD_BODIES = [
    pytest.param(GOOD + b"\n{not json\n", 400, "line 2", id="malformed-json"),
    pytest.param(
        GOOD
        + b"\n"
        + json.dumps(
            {"method": "POST", "url": "/v1/chat/completions", "body": chat_line("a")["body"]}
        ).encode(),
        400,
        "custom_id",
        id="missing-id",
    ),
    pytest.param(GOOD + b"\n" + GOOD, 400, "duplicate custom_id", id="duplicate-id"),
    pytest.param(_line(url="/v1/completions"), 400, "'url'", id="wrong-url"),
    pytest.param(_line(body={"model": "gpt-nope"}), 400, "unknown model", id="unknown-model"),
    pytest.param(
        json.dumps(
            {
                "custom_id": "m",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "sim-small"},
            }
        ).encode(),
        400,
        "body.messages",
        id="missing-messages",
    ),
    pytest.param(_line(body={"max_tokens": 0}), 400, "greater than 0", id="max-tokens-zero"),
    pytest.param(_line(body={"max_tokens": 10**6}), 400, "exceeds the limit", id="max-tokens-big"),
    pytest.param(
        _line(body={"messages": [{"role": "user", "content": "word " * 20000}]}),
        400,
        "context window",
        id="prompt-too-long",
    ),
    pytest.param(b"", 400, "empty", id="empty-file"),
    pytest.param(b"\n\n", 400, "empty", id="blank-lines-only"),
    pytest.param(GOOD + b"\n" + b'{"custom_id": "\xff\xfe"}', 400, "UTF-8", id="not-utf8"),
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD_BODIES)
def test_bad_input_is_rejected_and_nothing_stored(api, key, body, status, needle):
    res = api.post("/v1/batches", data=body, headers=_auth(key))
    assert res.status_code == status, res.json
    assert needle in res.json["error"]["message"]
    assert _stored() == (0, 0)


def test_bad_line_reports_line_number_and_field(api, key):
    body = GOOD + b"\n" + _line(custom_id="b", body={"max_tokens": -5})
    res = api.post("/v1/batches", data=body, headers=_auth(key))
    assert res.status_code == 400
    assert res.json["error"]["line"] == 2
    assert res.json["error"]["param"] == "body.max_tokens"


def test_too_many_lines_is_413(api, key, monkeypatch):
    monkeypatch.setattr(get_settings().submit, "max_batch_lines", 3)
    body = jsonl([chat_line(f"l{i}") for i in range(4)])
    res = api.post("/v1/batches", data=body, headers=_auth(key))
    assert res.status_code == 413
    assert _stored() == (0, 0)


def test_too_many_bytes_is_413(api, key, monkeypatch):
    monkeypatch.setattr(get_settings().submit, "max_body_bytes", 500)
    body = jsonl([chat_line(f"l{i}") for i in range(10)])
    res = api.post("/v1/batches", data=body, headers=_auth(key))
    assert res.status_code == 413
    assert _stored() == (0, 0)


@pytest.mark.parametrize("header", [None, "Bearer nope", "Basic abc", "Bearer "])
def test_missing_or_unknown_key_is_401(api, key, header):
    headers = {"Authorization": header} if header else {}
    res = api.post("/v1/batches", data=GOOD, headers=headers)
    assert res.status_code == 401
    assert api.get("/v1/batches", headers=headers).status_code == 401
    assert _stored() == (0, 0)


def test_a_suspended_tenants_key_is_401(api, key):
    from batchgen.store import tenants

    with db.session_scope() as s:
        tenants.revoke(s, "acme")
    res = api.post("/v1/batches", data=GOOD, headers=_auth(key))
    assert res.status_code == 401
    assert "suspended" in res.json["error"]["message"]


def test_another_tenants_batch_is_404(api, key):
    other = make_tenant("globex")
    batch_id = api.post("/v1/batches", data=GOOD, headers=_auth(key)).json["id"]
    for method, path in [
        ("get", f"/v1/batches/{batch_id}"),
        ("get", f"/v1/batches/{batch_id}/results"),
        ("post", f"/v1/batches/{batch_id}/cancel"),
    ]:
        res = getattr(api, method)(path, headers=_auth(other))
        assert res.status_code == 404, path
    assert api.get("/v1/batches", headers=_auth(other)).json["data"] == []
    assert api.get(f"/v1/batches/{batch_id}", headers=_auth(key)).status_code == 200


def test_idempotency_key_returns_the_same_batch(api, key):
    headers = {**_auth(key), "Idempotency-Key": "nightly-2026-11-29"}
    first = api.post("/v1/batches", data=GOOD, headers=headers)
    second = api.post("/v1/batches", data=GOOD, headers=headers)
    assert first.status_code == second.status_code == 200
    assert first.json["id"] == second.json["id"]
    assert second.headers.get("Idempotent-Replayed") == "true"
    assert _stored() == (1, 1)


def test_list_is_paginated_newest_first(api, key):
    ids = [
        api.post("/v1/batches", data=_line(custom_id=f"c{i}"), headers=_auth(key)).json["id"]
        for i in range(3)
    ]
    page1 = api.get("/v1/batches?limit=2", headers=_auth(key)).json
    assert [b["id"] for b in page1["data"]] == ids[::-1][:2]
    assert page1["has_more"] is True
    page2 = api.get(f"/v1/batches?limit=2&after={page1['last_id']}", headers=_auth(key)).json
    assert [b["id"] for b in page2["data"]] == [ids[0]]


def test_cancel_pending_batch_cancels_every_item(api, key):
    body = jsonl([chat_line(f"c{i}") for i in range(5)])
    batch_id = api.post("/v1/batches", data=body, headers=_auth(key)).json["id"]
    res = api.post(f"/v1/batches/{batch_id}/cancel", headers=_auth(key))
    assert res.status_code == 200
    assert res.json["status"] == "cancelled"
    assert res.json["request_counts"]["cancelled"] == 5
    results = api.get(f"/v1/batches/{batch_id}/results", headers=_auth(key)).data.splitlines()
    assert [json.loads(r)["error"]["code"] for r in results] == ["cancelled"] * 5


def test_bad_completion_window_is_400(api, key):
    res = api.post("/v1/batches?completion_window=soon", data=GOOD, headers=_auth(key))
    assert res.status_code == 400
    assert "completion_window" in res.json["error"]["message"]
    assert _stored() == (0, 0)


def test_concurrent_submits_with_one_idempotency_key_store_one_batch(key):
    """Two submits racing with the same key: one batch, both answers name it, no 500."""
    import threading

    from batchgen import python_api as client

    rows = [chat_line(f"i{i}") for i in range(300)]  # slow enough for the two to overlap
    answers: list = []

    def submit() -> None:
        answers.append(client.submit_batch(rows, tenant="acme", idempotency_key="race-1")["id"])

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 2 and answers[0] == answers[1]
    assert _stored() == (1, 300)


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


def _message_request(model: str) -> dict:
    content = [{"type": "text", "text": "What is this?"}, IMAGE]
    return {"max_tokens": 20, "model": model, "messages": [{"role": "user", "content": content}]}


def test_an_image_for_a_chat_model_is_refused_by_name(api, key):
    """A Message Batch request with an image, for a model an OpenAI-kind provider serves
    (it would be sent the text alone): 400 naming the request and the block, nothing
    stored; the same for a synchronous /v1/messages call. For an Anthropic model it is
    stored, to travel whole (tests/integration/test_whole_answers.py runs that)."""
    text_only = [{"role": "user", "content": "hi"}]
    ok = {"custom_id": "ok", "params": {**_message_request("sim-small"), "messages": text_only}}
    requests = [ok, {"custom_id": "img", "params": _message_request("sim-small")}]
    r = api.post("/v1/messages/batches", json={"requests": requests}, headers=_auth(key))
    assert r.status_code == 400, r.get_json()
    error = r.get_json()["error"]
    assert error["param"] == "params.messages[0].content[1]" and error["line"] == 2
    assert error["message"].startswith("requests[1].params.messages[0].content[1]: ")
    assert _stored() == (0, 0)

    call = api.post("/v1/messages", json=_message_request("sim-small"), headers=_auth(key))
    assert call.status_code == 400 and "content[1]" in call.get_json()["error"]["message"]
    assert _stored() == (0, 0)

    requests[1]["params"]["model"] = "sim-claude"
    r = api.post("/v1/messages/batches", json={"requests": requests[1:]}, headers=_auth(key))
    assert r.status_code == 200, r.get_json()
    assert _stored() == (1, 1)
