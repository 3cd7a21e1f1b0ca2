"""SDK batches without a priority: a completion window of 24 h or more makes them bulk,
so they may go to the providers' half-price Batch APIs; a shorter window, or a priority
the caller names, keeps what it says."""

from __future__ import annotations

import io
import json

import pytest

from batchgen.api import create_app
from tests.helpers import chat_line, make_tenant, message_request

pytestmark = pytest.mark.integration


@pytest.fixture
def sdk(clean_db):  # type: ignore[no-untyped-def]
    key = make_tenant("sdk-priority")
    return create_app().test_client(), {"Authorization": f"Bearer {key}"}


def _upload(api, auth) -> str:  # type: ignore[no-untyped-def]
    data = json.dumps(chat_line("one")).encode() + b"\n"
    res = api.post(
        "/v1/files", headers=auth, data={"purpose": "batch", "file": (io.BytesIO(data), "r.jsonl")}
    )
    assert res.status_code == 200, res.text
    return str(res.json["id"])


@pytest.mark.parametrize(
    ("window", "given", "expected"),
    [
        ("24h", None, "bulk"),
        ("48h", None, "bulk"),
        ("1h", None, "interactive"),
        ("24h", "interactive", "interactive"),
        ("1h", "bulk", "bulk"),
    ],
)
def test_openai_batch_priority_follows_its_window(sdk, window, given, expected):
    api, auth = sdk
    body = {
        "input_file_id": _upload(api, auth),
        "endpoint": "/v1/chat/completions",
        "completion_window": window,
    }
    if given is not None:
        body["priority"] = given
    res = api.post("/v1/batches", headers=auth, json=body)
    assert res.status_code == 200, res.text
    assert res.json["priority"] == expected


def test_anthropic_message_batch_defaults_to_bulk(sdk):
    """Anthropic's Message Batches have no window: the default one (24 h) makes them bulk."""
    api, auth = sdk
    res = api.post("/v1/messages/batches", headers=auth, json={"requests": [message_request("a")]})
    assert res.status_code == 200, res.text
    mine = api.get(f"/v1/batches/{res.json['id']}", headers=auth)
    assert mine.json["priority"] == "bulk"
    told = api.post(
        "/v1/messages/batches",
        headers=auth,
        json={"requests": [message_request("b")], "priority": "interactive"},
    )
    assert api.get(f"/v1/batches/{told.json['id']}", headers=auth).json["priority"] == "interactive"
