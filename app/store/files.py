"""Files, as the OpenAI Files API serves them: uploads kept in PostgreSQL, and each
finished batch's output and error files, read from its results.

An upload (``purpose="batch"``) is validated line by line at upload, exactly as a
submit is (:func:`batchgen.domain.formats.admission.parse_lines`), all or nothing, held
against the tenant's file quota (:func:`batchgen.store.quotas.check_files`), and
stored whole in ``files.content``, so that a second API host sees it. It expires
``file_retention_s`` after its upload (or sooner, by its ``expires_after``); an
expired file is gone for every reader at once and the sweep deletes its row.

A batch's output file (``file-<batch id>-output``: its succeeded requests) and
error file (``file-<batch id>-errors``: failed, expired and cancelled ones) are
not copies: their lines are rendered from the results by PostgreSQL when read, in
OpenAI's output format, and their sizes are rolled up with the batch's totals. They
exist once the batch is finished, and go with the batch.

An upload is stored uncompressed and read in pieces (:func:`upload_pieces`), so a
batch is created from a large upload without holding it whole.
"""

from __future__ import annotations

import datetime as dt
import io
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain import submission
from batchgen.domain.lifecycle.status import ItemStatus
from batchgen.errors import NotFound, PayloadTooLarge, ValidationFailed
from batchgen.registry import Registry
from batchgen.store import batches, quotas, totals
from batchgen.store.batches import (
    ERROR_STATUSES,
    ERRORS,
    OUTPUT,
    output_file_id,
    output_file_ids,
)
from batchgen.store.schema import Batch, File, Tenant
from batchgen.store.sqlfiles import query

BATCH_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
MAX_FILENAME_CHARS = 255
# An upload's id, and the id of a batch's output or error file.
FILE_ID = re.compile(r"file-[0-9a-f]{24}")
OUTPUT_FILE_ID = re.compile(r"file-(batch_[0-9a-f]{32})-(output|errors)")
# An upload is read back in pieces of this size.
PIECE_BYTES = 1024 * 1024


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


def _ts(value: dt.datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def store_file(
    session: Session,
    tenant: Tenant,
    content: bytes,
    *,
    filename: str,
    purpose: str,
    expires_after_s: int | None,
    registry: Registry,
    settings: Settings,
) -> File:
    """Validate an upload (every line, all or nothing) and store it whole."""
    if purpose != BATCH_PURPOSE:
        raise ValidationFailed(
            f"purpose must be {BATCH_PURPOSE!r} (files feed batches here)", field="purpose"
        )
    if len(content) > settings.submit.max_body_bytes:
        raise PayloadTooLarge(f"file larger than {settings.submit.max_body_bytes} bytes")
    if not filename or len(filename) > MAX_FILENAME_CHARS or not filename.isprintable():
        raise ValidationFailed(
            f"filename must be 1 to {MAX_FILENAME_CHARS} printable characters", field="file"
        )
    retention_s = settings.files.retention_s
    if expires_after_s is not None:
        if not 3600 <= expires_after_s <= retention_s:
            raise ValidationFailed(
                f"expires_after[seconds] must be between 3600 and {retention_s}",
                field="expires_after",
            )
        retention_s = expires_after_s
    line_count = submission.count_lines(_lines(content), registry, settings)
    quotas.check_files(session, tenant, len(content), settings)
    now = session.scalar(select(func.now()))
    assert now is not None
    file = File(
        id=new_file_id(),
        tenant_id=tenant.id,
        purpose=purpose,
        filename=filename,
        size_bytes=len(content),
        line_count=line_count,
        content=content,
        created_at=now,
        expires_at=now + dt.timedelta(seconds=retention_s),
    )
    session.add(file)
    session.flush()
    return file


def _lines(content: bytes) -> Iterator[bytes]:
    """The lines of an upload as a batch made from it reads them (split at ``\\n``)."""
    yield from io.BytesIO(content)


def _alive(query: Any) -> Any:
    return query.where((File.expires_at.is_(None)) | (File.expires_at > func.now()))


def get_file(session: Session, tenant: Tenant, file_id: str) -> File:
    """One of the tenant's uploads; :class:`NotFound` for another tenant's, an expired
    one, or an id that is none."""
    found = None
    if FILE_ID.fullmatch(file_id):
        found = session.scalar(
            _alive(select(File).where(File.id == file_id, File.tenant_id == tenant.id))
        )
    if found is None:
        raise NotFound(f"no file {file_id!r}", field="file_id")
    return found


def upload_pieces(session: Session, tenant: Tenant, file_id: str) -> Iterator[bytes]:
    """One of the tenant's uploads, read in pieces of :data:`PIECE_BYTES` (one query
    each: the content is stored uncompressed, so each reads its part alone)."""
    file = get_file(session, tenant, file_id)
    for start in range(0, file.size_bytes, PIECE_BYTES):
        piece = session.scalar(
            select(func.substring(File.content, start + 1, PIECE_BYTES)).where(File.id == file.id)
        )
        yield piece or b""


def describe_file(file: File) -> dict[str, Any]:
    """An upload as OpenAI's ``FileObject``."""
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.size_bytes,
        "created_at": _ts(file.created_at),
        "expires_at": _ts(file.expires_at),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
    }


def list_page(
    session: Session,
    tenant: Tenant,
    *,
    limit: int = 10_000,
    after: str | None = None,
    order: str = "desc",
    purpose: str | None = None,
) -> tuple[list[File], bool]:
    """One page of the tenant's uploads by creation time, and whether more follow."""
    if not 1 <= limit <= 10_000:
        raise ValidationFailed("limit must be between 1 and 10000", field="limit")
    if order not in ("asc", "desc"):
        raise ValidationFailed("order must be 'asc' or 'desc'", field="order")
    query = _alive(select(File).where(File.tenant_id == tenant.id))
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    key = (File.created_at, File.id)
    if after is not None:
        anchor = get_file(session, tenant, after)
        mark = (anchor.created_at, anchor.id)
        query = query.where(key < mark if order == "desc" else key > mark)  # type: ignore[operator]
    ordering = [k.desc() for k in key] if order == "desc" else list(key)
    rows = list(session.scalars(query.order_by(*ordering).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def delete_file(session: Session, tenant: Tenant, file_id: str) -> dict[str, Any]:
    """Delete one of the tenant's uploads (batches made from it keep their items)."""
    if OUTPUT_FILE_ID.fullmatch(file_id):
        batches.get_owned_batch(session, tenant, OUTPUT_FILE_ID.fullmatch(file_id)[1])  # type: ignore[index]
        raise ValidationFailed(
            "a batch's output and error files are its results: they go with the batch",
            field="file_id",
        )
    file = get_file(session, tenant, file_id)
    session.delete(file)
    return {"id": file.id, "object": "file", "deleted": True}


def delete_expired(session: Session) -> int:
    """The sweep's part: delete uploads past their expiry; returns how many."""
    result = session.execute(delete(File).where(File.expires_at <= func.now()))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


# --- a batch's output and error files ---------------------------------------------

# The item statuses in each of a batch's files.
FILE_STATUSES = {
    OUTPUT: (ItemStatus.SUCCEEDED.value,),
    ERRORS: tuple(s.value for s in ERROR_STATUSES),
}
# Lines per piece of a file's download (one fetch of the server-side cursor).
LINES_PER_CHUNK = 2000


@dataclass(frozen=True)
class OutputFile:
    batch: Batch
    kind: str  # OUTPUT or ERRORS
    # Its size from the batch's totals (None: rolled up before sizes were counted).
    size_bytes: int | None

    @property
    def id(self) -> str:
        return output_file_id(self.batch.id, self.kind)

    def params(self) -> dict[str, Any]:
        return {"batch_id": self.batch.id, "statuses": list(FILE_STATUSES[self.kind])}


def get_output_file(
    session: Session, tenant: Tenant, file_id: str, *, sized: bool = False
) -> OutputFile | None:
    """The batch output or error file ``file_id`` names (None: the id is an upload's);
    :class:`NotFound` if its batch is not the tenant's or the file does not exist. Read
    from the batch's totals (a finished batch's counts, and with ``sized`` its files'
    sizes), not its items."""
    match = OUTPUT_FILE_ID.fullmatch(file_id)
    if match is None:
        return None
    batch = batches.get_readable_batch(session, tenant, match[1])
    if batch.finished_at is not None:
        if sized:
            per_status = totals.batch_files(session, batch.id)
            counts = {status: f.items for status, f in per_status.items()}
        else:
            counts = batches.request_counts(session, batch)
        if file_id in output_file_ids(batch, counts):
            size = None
            if sized:
                sizes = [per_status[s].bytes for s in FILE_STATUSES[match[2]] if s in per_status]
                size = None if None in sizes else sum(b or 0 for b in sizes)
            return OutputFile(batch, match[2], size)
    raise NotFound(f"no file {file_id!r}", field="file_id")


def output_chunks(session: Session, output: OutputFile) -> Iterator[bytes]:
    """The file's JSONL lines in input order, in pieces of :data:`LINES_PER_CHUNK`
    lines, rendered by PostgreSQL (:file:`sql/include/output_line.sql`) and read
    through a server-side cursor: memory stays flat however large the batch."""
    result = session.execute(
        query("output_file_lines"),
        output.params(),
        execution_options={"yield_per": LINES_PER_CHUNK},
    )
    for rows in result.partitions():
        yield "".join([row.line for row in rows]).encode("utf-8")


def describe_output(session: Session, output: OutputFile) -> dict[str, Any]:
    """The output or error file as a ``FileObject`` (its size is that of its lines)."""
    size = output.size_bytes
    if size is None:  # rolled up before the sizes were: count its lines once
        size = int(session.scalar(query("output_file_bytes"), output.params()) or 0)
    return {
        "id": output.id,
        "object": "file",
        "bytes": size,
        "created_at": _ts(output.batch.finished_at),
        "expires_at": None,
        "filename": f"{output.batch.id}_{output.kind}.jsonl",
        "purpose": OUTPUT_PURPOSE,
        "status": "processed",
        "status_details": None,
    }
