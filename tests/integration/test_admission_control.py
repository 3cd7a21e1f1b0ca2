"""Bounded admission: a full model answers 503, a tenant over its limits 429; nothing stored."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from batchgen import python_api as client
from batchgen.api import create_app
from batchgen.config import get_settings
from batchgen.errors import Overloaded, OverQuota
from batchgen.store import db
from batchgen.store.schema import Batch, Item
from tests.helpers import chat_line, jsonl, make_tenant

pytestmark = pytest.mark.integration


def _stored() -> tuple[int, int]:
    with db.session_scope() as s:
        return (
            s.scalar(select(func.count()).select_from(Batch)),
            s.scalar(select(func.count()).select_from(Item)),
        )


def _rows(prefix: str, n: int, max_tokens: int = 100) -> list[dict]:
    return [chat_line(f"{prefix}{i}", max_tokens=max_tokens) for i in range(n)]


@pytest.fixture
def small_backlog(clean_db, monkeypatch):
    # sim-small: 2 000 000 tokens/min; 0.001 min of it = a 2 000-token backlog bound
    monkeypatch.setattr(get_settings().submit, "max_backlog_min", 0.001)


def test_model_backlog_full_is_503_with_retry_after(small_backlog):
    api = create_app().test_client()
    key = make_tenant("acme")
    auth = {"Authorization": f"Bearer {key}"}
    first = api.post("/v1/batches", data=jsonl(_rows("a", 10)), headers=auth)  # ~1 100 tokens
    assert first.status_code == 200
    before = _stored()
    second = api.post("/v1/batches", data=jsonl(_rows("b", 10)), headers=auth)
    assert second.status_code == 503
    assert int(second.headers["Retry-After"]) >= 1
    assert second.json["error"]["code"] == "overloaded"
    assert _stored() == before  # nothing of the rejected batch


def test_batch_larger_than_the_bound_is_413(small_backlog):
    make_tenant("acme")
    with pytest.raises(Exception) as info:
        client.submit_batch(_rows("c", 30), tenant="acme")
    assert getattr(info.value, "status_code", None) == 413
    assert _stored() == (0, 0)


def test_python_api_raises_typed_errors_with_retry_advice(small_backlog):
    make_tenant("acme")
    client.submit_batch(_rows("a", 10), tenant="acme")
    with pytest.raises(Overloaded) as info:
        client.submit_batch(_rows("b", 10), tenant="acme")
    assert info.value.retry_after_s >= 1


def test_tenant_over_pending_items_is_429(clean_db):
    api = create_app().test_client()
    key = make_tenant("small", max_pending_items=5)
    auth = {"Authorization": f"Bearer {key}"}
    assert api.post("/v1/batches", data=jsonl(_rows("a", 5)), headers=auth).status_code == 200
    res = api.post("/v1/batches", data=jsonl(_rows("b", 1)), headers=auth)
    assert res.status_code == 429
    assert res.json["error"]["code"] == "tenant_over_quota"
    assert int(res.headers["Retry-After"]) >= 1
    assert _stored() == (1, 5)
    # another tenant is not affected
    make_tenant("other")
    assert client.submit_batch(_rows("c", 3), tenant="other")["request_counts"]["total"] == 3


def test_tenant_over_daily_token_quota_is_429_until_midnight(clean_db):
    make_tenant("metered", daily_token_quota=1000)
    with pytest.raises(OverQuota) as info:
        client.submit_batch(_rows("a", 10), tenant="metered")  # ~1 100 tokens
    assert 1 <= info.value.retry_after_s <= 86400
    assert _stored() == (0, 0)
    assert client.submit_batch(_rows("b", 5), tenant="metered")["request_counts"]["total"] == 5
