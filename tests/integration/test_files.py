"""Uploaded files in PostgreSQL: validated whole at upload, bounded, owned by a tenant,
and gone once they expire (the sweep deletes the row)."""

from __future__ import annotations

import io
import json

import pytest
from sqlalchemy import func, select, text, update

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


# Custom ids and texts that JSON escapes: quotes, a backslash, non-ASCII, an emoji.
ODD_IDS = ['say "hi"', "back\\slash", "ünïcødé-ß", "emoji-\U0001f600", "plain", "late"]


def _finish_by_hand(batch_id: str) -> None:
    """End the batch's items as workers would have: results for the first four (their
    answers with escapes, non-ASCII text, numbers and nulls), then a failure with a
    message to escape, an expiry; the batch closes."""
    from batchgen.store import batches

    with db.session_scope() as s:
        rows = s.execute(
            text("SELECT id, custom_id FROM items WHERE batch_id = :b ORDER BY line_no"),
            {"b": batch_id},
        ).all()
        for n, (item_id, custom_id) in enumerate(rows[:4]):
            answer = {
                "id": f"chatcmpl-{n}",
                "choices": [{"message": {"content": f'«{custom_id}»\n"x"\\', "role": "a"}}],
                "usage": {"prompt_tokens": 3, "total": 1.5e-7, "none": None},
            }
            s.execute(
                text(
                    "INSERT INTO results (item_id, batch_id, tenant_id, attempt, response, "
                    "provider_request_id, prompt_tokens, completion_tokens, cost_usd, "
                    "upstream_latency_ms, queue_wait_ms) SELECT id, batch_id, tenant_id, 1, "
                    "CAST(:r AS jsonb), :rid, 3, 4, 0.01, 10, 20 FROM items WHERE id = :i"
                ),
                {"r": json.dumps(answer), "i": item_id, "rid": None if n == 3 else f"req-{n}"},
            )
        ends = [("succeeded", None, None)] * 4
        ends += [("failed", "bad_request", 'the "provider"\nsaid no'), ("expired", "expired", None)]
        for (item_id, _), (status, code, message) in zip(rows, ends, strict=True):
            s.execute(
                text(
                    "UPDATE items SET status = :st, error_code = :c, last_error = :m, "
                    "finished_at = now(), started_at = now() WHERE id = :i"
                ),
                {"st": status, "c": code, "m": message, "i": item_id},
            )
        batches.refresh_status(s, batch_id)


def _content(file_id: str, tenant: str) -> bytes:
    return b"".join(python_api.iter_file_content(file_id, tenant=tenant))


def test_output_and_error_files_are_their_lines_and_their_size_is_read_from_totals(clean_db):
    """The files PostgreSQL renders parse to the batch's results, in input order, with
    OpenAI's codes for the requests never run to their end; the size a file's metadata
    gives is its content's, counted in the totals' tail, after a roll-up, and counted
    from the lines for totals rolled up before sizes were."""
    from batchgen.store import totals

    make_tenant("out")
    lines = [chat_line(c) for c in ODD_IDS]
    batch = python_api.submit_batch(lines, tenant="out")
    _finish_by_hand(batch["id"])
    done = python_api.get_batch(batch["id"], tenant="out")
    assert done["request_counts"]["completed"] == 4
    output_id, error_id = done["output_file_id"], done["error_file_id"]

    output = _content(output_id, tenant="out")
    errors = _content(error_id, tenant="out")
    expected = list(python_api.iter_results(batch["id"], tenant="out"))
    assert [json.loads(x) for x in output.splitlines()] == expected[:4]
    parsed = [json.loads(x) for x in errors.splitlines()]
    assert [(r["custom_id"], r["error"]) for r in parsed] == [
        ("plain", {"code": "bad_request", "message": 'the "provider"\nsaid no'}),
        ("late", {"code": "batch_expired", "message": None}),
    ]
    assert [r["response"] for r in parsed] == [None, None]

    def sizes() -> tuple[int, int]:
        return tuple(python_api.get_file(f, tenant="out")["bytes"] for f in (output_id, error_id))

    assert sizes() == (len(output), len(errors))  # the tail: nothing rolled up yet
    with db.session_scope() as s:
        assert totals.roll_up(s, lag_s=0)
    assert sizes() == (len(output), len(errors))  # rolled up
    with db.session_scope() as s:  # read from the totals, not rendered again
        s.execute(text("UPDATE batch_totals SET bytes = bytes + 1 WHERE status = 'succeeded'"))
    assert sizes() == (len(output) + 1, len(errors))
    with db.session_scope() as s:
        s.execute(text("UPDATE batch_totals SET bytes = NULL"))
    assert sizes() == (len(output), len(errors))  # counted from the lines
    assert (_content(output_id, "out"), _content(error_id, "out")) == (output, errors)


def test_a_batch_from_an_upload_reads_it_in_pieces(clean_db, monkeypatch):
    """A batch made from an upload larger than a piece gets every line of it, in order."""
    from batchgen.store import files

    monkeypatch.setattr(files, "PIECE_BYTES", 1000)  # lines span the pieces
    make_tenant("pieces")
    content = _jsonl(40, prefix="p")
    assert len(content) > 5 * files.PIECE_BYTES
    stored = python_api.upload_file(content, tenant="pieces", filename="p.jsonl")
    assert _content(stored["id"], tenant="pieces") == content
    made, created = python_api.create_batch(tenant="pieces", input_file_id=stored["id"])
    assert created and made["request_counts"]["total"] == 40
    with db.session_scope() as s:
        ids = s.scalars(
            text("SELECT custom_id FROM items WHERE batch_id = :b ORDER BY line_no"),
            {"b": made["id"]},
        ).all()
    assert ids == [f"p-{i}" for i in range(40)]
