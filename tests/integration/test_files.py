"""Uploaded files in PostgreSQL: validated whole at upload, bounded, owned by a tenant,
and gone once they expire (the sweep deletes the row)."""

from __future__ import annotations

import io
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


def test_a_tenants_files_are_bounded_by_count_and_deletes_free_the_quota(clean_db):
    """Issue 27 item 5: a tenant's own max_files; over it a 429 in OpenAI's shape,
    with Retry-After; deleting a file frees its place; other tenants are not held."""
    from batchgen.api import create_app

    key = make_tenant("counted", max_files=2)
    other = make_tenant("roomy")
    api = create_app().test_client()

    def upload(who: str, n: int) -> object:
        return api.post(
            "/v1/files",
            headers={"Authorization": f"Bearer {who}"},
            data={"purpose": "batch", "file": (io.BytesIO(_jsonl(n)), "f.jsonl")},
        )

    first, second = upload(key, 1), upload(key, 2)
    assert first.status_code == second.status_code == 200
    refused = upload(key, 3)
    assert refused.status_code == 429, refused.text
    error = refused.json["error"]
    assert error["code"] == "file_quota_exceeded"
    assert "keeps 2 files" in error["message"] and "quota is 2 files" in error["message"]
    assert int(refused.headers["Retry-After"]) > 3600  # the first file expires in 30 days
    assert _files() == 2
    assert upload(other, 1).status_code == 200  # another tenant's quota is its own
    deleted = api.delete(
        f"/v1/files/{first.json['id']}", headers={"Authorization": f"Bearer {key}"}
    )
    assert deleted.status_code == 200
    assert upload(key, 3).status_code == 200


def test_a_tenants_file_bytes_are_bounded_and_expired_files_free_them(clean_db, monkeypatch):
    """The deployment's BATCHGEN_TENANT_MAX_FILE_BYTES holds for a tenant without its
    own; a file alone over it is a 413; an expired file no longer counts."""
    from batchgen.errors import FileQuotaExceeded

    make_tenant("bytes")
    content = _jsonl(5)
    monkeypatch.setenv("BATCHGEN_TENANT_MAX_FILE_BYTES", str(2 * len(content)))
    get_settings.cache_clear()
    try:
        python_api.upload_file(content, tenant="bytes", filename="a.jsonl")
        python_api.upload_file(content, tenant="bytes", filename="b.jsonl")
        with pytest.raises(FileQuotaExceeded, match="bytes of files") as raised:
            python_api.upload_file(_jsonl(1), tenant="bytes", filename="c.jsonl")
        assert raised.value.status_code == 429
        with pytest.raises(PayloadTooLarge, match="file quota"):
            python_api.upload_file(_jsonl(11), tenant="bytes", filename="d.jsonl")
        assert _files() == 2
        with db.session_scope() as s:  # one expires
            first = s.scalar(select(File.id).order_by(File.created_at).limit(1))
            s.execute(
                update(File)
                .where(File.id == first)
                .values(expires_at=func.now() - func.make_interval(0, 0, 0, 0, 0, 1))
            )
        python_api.upload_file(content, tenant="bytes", filename="e.jsonl")
    finally:
        monkeypatch.delenv("BATCHGEN_TENANT_MAX_FILE_BYTES")
        get_settings.cache_clear()
