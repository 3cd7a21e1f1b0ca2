"""Uploaded files in PostgreSQL: validated whole at upload, bounded, owned by a tenant,
and gone once they expire (the sweep deletes the row)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select, update

from batchgen import python_api
from batchgen.config import get_settings
from batchgen.errors import NotFound, PayloadTooLarge, ValidationFailed
from batchgen.store import db
from batchgen.store.schema import Batch, File
from batchgen.worker.sweep import sweep
from tests.helpers import chat_line, make_tenant

pytestmark = pytest.mark.integration


def _jsonl(n: int, prefix: str = "f") -> bytes:
    return b"".join(json.dumps(chat_line(f"{prefix}-{i}")).encode() + b"\n" for i in range(n))


def _files() -> int:
    with db.session_scope() as s:
        return int(s.scalar(select(func.count()).select_from(File)) or 0)


def test_an_upload_is_validated_whole_and_a_bad_one_stores_nothing(clean_db):
    make_tenant("up")
    good = _jsonl(3)
    bad = good + b'{"custom_id": "x", "url": "/v1/chat/completions"}\n'
    with pytest.raises(ValidationFailed) as raised:
        python_api.upload_file(bad, tenant="up", filename="bad.jsonl")
    assert raised.value.line == 4 and raised.value.field == "body"
    with pytest.raises(ValidationFailed):
        python_api.upload_file(good, tenant="up", filename="x.jsonl", purpose="assistants")
    assert _files() == 0
    stored = python_api.upload_file(good, tenant="up", filename="good.jsonl")
    assert (stored["bytes"], stored["filename"]) == (len(good), "good.jsonl")
    assert b"".join(python_api.iter_file_content(stored["id"], tenant="up")) == good


def test_an_upload_above_the_bound_is_refused(clean_db, monkeypatch):
    make_tenant("big")
    content = _jsonl(50)
    monkeypatch.setenv("BATCHGEN_MAX_BODY_BYTES", str(len(content) - 1))
    get_settings.cache_clear()
    try:
        with pytest.raises(PayloadTooLarge):
            python_api.upload_file(content, tenant="big", filename="big.jsonl")
    finally:
        monkeypatch.delenv("BATCHGEN_MAX_BODY_BYTES")
        get_settings.cache_clear()
    assert _files() == 0


def test_a_file_is_its_tenants_alone(clean_db):
    make_tenant("owner")
    make_tenant("other")
    stored = python_api.upload_file(_jsonl(2), tenant="owner", filename="a.jsonl")
    for call in (python_api.get_file, python_api.delete_file, python_api.check_file):
        with pytest.raises(NotFound):
            call(stored["id"], tenant="other")
    with pytest.raises(NotFound):
        python_api.create_batch(tenant="other", input_file_id=stored["id"])
    assert python_api.list_files_page(tenant="other")["data"] == []
    assert [f["id"] for f in python_api.list_files_page(tenant="owner")["data"]] == [stored["id"]]


def test_an_expired_file_is_gone_at_once_and_the_sweep_deletes_it(clean_db):
    make_tenant("keep")
    stored = python_api.upload_file(
        _jsonl(2), tenant="keep", filename="short.jsonl", expires_after_s=3600
    )
    assert stored["expires_at"] - stored["created_at"] == 3600
    batch, _ = python_api.create_batch(tenant="keep", input_file_id=stored["id"])
    with pytest.raises(ValidationFailed):  # shorter than an hour, or beyond the retention
        python_api.upload_file(_jsonl(1), tenant="keep", filename="x.jsonl", expires_after_s=60)
    with db.session_scope() as s:
        s.execute(update(File).values(expires_at=func.now() - func.make_interval(0, 0, 0, 0, 0, 1)))
    with pytest.raises(NotFound):
        python_api.get_file(stored["id"], tenant="keep")
    with pytest.raises(NotFound):
        python_api.create_batch(tenant="keep", input_file_id=stored["id"])
    with db.session_scope() as s:
        report = sweep(s, get_settings())
    assert report.files_deleted == 1 and _files() == 0
    with db.session_scope() as s:  # the batch made from it stays, and still names it
        kept = s.get(Batch, batch["id"])
        assert kept is not None and kept.input_file_id == stored["id"] and kept.total_items == 2
