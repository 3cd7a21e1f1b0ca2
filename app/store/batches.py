"""Batches: storing a submission all-or-nothing, reading it back, cancelling it.

Every function takes the caller's tenant and answers :class:`NotFound` for a
batch of another tenant, exactly as for one that does not exist. An admin key
may read every tenant's batches (:func:`get_readable_batch`); changing a batch
(a cancel) is its owner's alone (:func:`get_owned_batch`).
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import exists, func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from batchgen.config import Settings
from batchgen.domain import submission
from batchgen.domain.lifecycle.deadlines import format_duration
from batchgen.domain.lifecycle.status import (
    OPEN,
    TERMINAL,
    BatchStatus,
    ItemStatus,
    Priority,
    batch_status,
    values,
)
from batchgen.domain.submission import BatchFrame, Prepared, SubmitOptions, Tally
from batchgen.errors import NotFound, ValidationFailed
from batchgen.registry import Registry
from batchgen.store import batch_notifications, items, quotas, rounds, totals
from batchgen.store.schema import Batch, Item, Result, Tenant, listed_batch
from batchgen.store.sqlfiles import query

OPEN_VALUES = values(OPEN)
# What a batch id can look like (``batch_`` + hex); anything else is no batch.
BATCH_ID = re.compile(r"[A-Za-z0-9_-]{1,40}")

# A finished batch's output file (its succeeded requests) and error file (the rest),
# rendered from its results when read (app/store/files.py).
OUTPUT, ERRORS = "output", "errors"
_FINISHED = frozenset({BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})
ERROR_STATUSES = (ItemStatus.FAILED, ItemStatus.EXPIRED, ItemStatus.CANCELLED)


def output_file_id(batch_id: str, kind: str) -> str:
    return f"file-{batch_id}-{kind}"


def output_file_ids(batch: Batch, counts: dict[str, int]) -> tuple[str | None, str | None]:
    """A batch's ``(output_file_id, error_file_id)``: set once it is finished, each when
    it has a line."""
    if batch.finished_at is None or batch.status not in _FINISHED:
        return None, None
    done = counts.get(ItemStatus.SUCCEEDED, 0)
    others = sum(counts.get(s, 0) for s in ERROR_STATUSES)
    return (
        output_file_id(batch.id, OUTPUT) if done else None,
        output_file_id(batch.id, ERRORS) if others else None,
    )


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex


def _find_idempotent(session: Session, tenant_id: int, key: str) -> Batch | None:
    return session.scalar(
        select(Batch).where(Batch.tenant_id == tenant_id, Batch.idempotency_key == key)
    )


def _frame(batch: Batch) -> BatchFrame:
    return BatchFrame(
        batch.id, batch.route, batch.offload, batch.priority, batch.created_at, batch.deadline_at
    )


# The item columns a submit writes, in the order of the rows' values
# (batchgen.domain.submission.item_rows).
COPY_COLUMNS = (
    "batch_id",
    "tenant_id",
    "line_no",
    "custom_id",
    "model",
    "priority_rank",
    "body",
    "prompt_tokens_est",
    "max_tokens",
    "status",
    "deadline_at",
    "dispatch_key",
    "route",
    "prefix_key",
)


def _copy_items(session: Session, rows: Iterable[dict[str, Any]]) -> int:
    """Stream the rows (``body`` as JSON text) into ``items`` with one ``COPY … FROM
    STDIN`` in the session's transaction, as they are validated (memory stays flat);
    returns how many. A bad line raises out of the COPY: it is aborted and the
    transaction rolls back."""
    connection = session.connection().connection.driver_connection
    assert connection is not None
    total = 0
    sql = f"COPY items ({', '.join(COPY_COLUMNS)}) FROM STDIN"
    with connection.cursor() as cursor, cursor.copy(sql) as copy:
        for row in rows:
            copy.write_row([row[c] for c in COPY_COLUMNS])
            total += 1
    return total


def _replay(existing: Batch, prep: Prepared) -> Batch:
    """The batch an Idempotency-Key named, once the request proves to be the same one
    (:func:`batchgen.domain.submission.check_replay`)."""
    submission.check_replay(
        existing.request_sha256,
        existing.idempotency_key,
        existing.id,
        prep.drafts,
        prep.fingerprint,
    )
    return existing


def store_batch(
    session: Session,
    tenant: Tenant,
    lines: Iterable[bytes],
    options: SubmitOptions,
    registry: Registry,
    settings: Settings,
) -> tuple[Batch, bool]:
    """Store a batch in the caller's transaction, as
    :mod:`batchgen.domain.submission` checks and routes it.

    Returns ``(batch, created)``; ``created`` is False when the idempotency key
    named an existing batch for the same request (another request under a used
    key raises :class:`IdempotencyKeyReused`). Any error leaves the transaction
    to be rolled back, so nothing of a bad batch is stored. Items are streamed
    into one COPY while the body is read, so a large file is neither held whole
    nor sent row by row.
    """
    prep = submission.prepare(tenant.tokens_per_min, lines, options, registry, settings)
    key = prep.key
    if key is not None:
        existing = _find_idempotent(session, tenant.id, key)
        if existing is not None:
            return _replay(existing, prep), False
    now = session.scalar(select(func.now()))
    assert now is not None
    batch = Batch(
        id=new_batch_id(),
        tenant_id=tenant.id,
        status=BatchStatus.IN_PROGRESS.value,
        endpoint=prep.endpoint or prep.first.endpoint,
        priority=prep.priority.value,
        completion_window_s=int(prep.window_s),
        deadline_at=now + dt.timedelta(seconds=prep.window_s),
        metadata_=options.metadata,
        idempotency_key=key,
        input_file_id=options.input_file_id,
        offload=prep.offload.value,
        route=prep.route.value,
        on_finished=prep.on_finished,
        on_finished_queue=prep.queue,
        webhook_url=prep.webhook_url,
        origin=options.origin,
        key_id=options.key_id,
        total_items=0,
        created_at=now,
    )
    try:
        with session.begin_nested():  # a concurrent twin with the same key waits here
            session.add(batch)
    except IntegrityError:
        # The twin committed first: the same request gets its batch, as a resubmit would.
        existing = _find_idempotent(session, tenant.id, key or "")
        if existing is None:
            raise
        return _replay(existing, prep), False

    tally = Tally()
    keys = rounds.next_keys(session, tenant.id)
    prefixes = submission.prefix_keys(registry)
    rows = submission.item_rows(
        prep.drafts, _frame(batch), tenant.id, tally, registry, keys, prefixes
    )
    total = _copy_items(session, rows)
    items.clear_prefix_keys(session, batch.id, prefixes.singles())
    batch.total_items = total
    batch.request_sha256 = prep.fingerprint.hexdigest()
    session.flush()
    totals.admit(session, tenant.id, {m: totals.Count(*c) for m, c in tally.admitted.items()})
    # A call's bound is the fail-fast rule (store/call_rows.py), not the backlog's.
    models = submission.backlog_models(tally.online_tokens, prep.priority)
    quotas.check_models(session, models, tally.online_tokens, registry, settings)
    quotas.check_tenant(session, tenant, registry, sorted(tally.online_tokens))
    return batch, True


@dataclass(frozen=True)
class CallRows:
    """A synchronous call's batch of one and its item, checked as :func:`store_batch`
    checks a batch, for the one statement that stores and releases them
    (:func:`batchgen.store.call_rows.store_plain_call`)."""

    batch: dict[str, Any]
    item: dict[str, Any]
    # The item's own deadline, in seconds from the batch's creation (its line's
    # ``timeout``, when shorter than the batch's window).
    item_window_s: float


def call_rows(
    tenant: Tenant, line: bytes, options: SubmitOptions, registry: Registry, settings: Settings
) -> CallRows | None:
    """The columns :func:`store_batch` would store for a call of one line (validated
    the same way, raising the same errors); None when the call needs
    :func:`store_batch` itself (:func:`batchgen.domain.submission.call_needs_full_store`),
    or an item it would not release at once (offloaded)."""
    if submission.call_needs_full_store(
        options, tenant.max_pending_items, tenant.daily_token_quota
    ):
        return None
    prep = submission.prepare(tenant.tokens_per_min, iter([line]), options, registry, settings)
    now = dt.datetime.now(dt.UTC)  # for the item's deadline and route; PostgreSQL's is stored
    frame = BatchFrame(
        id=new_batch_id(),
        route=prep.route.value,
        offload=prep.offload.value,
        priority=prep.priority.value,
        created_at=now,
        deadline_at=now + dt.timedelta(seconds=prep.window_s),
    )
    prefixes = submission.prefix_keys(registry)
    rows = list(
        submission.item_rows(prep.drafts, frame, tenant.id, Tally(), registry, {}, prefixes)
    )
    if len(rows) != 1 or rows[0]["status"] != ItemStatus.PENDING.value:
        return None
    item = {**rows[0], "prefix_key": None}  # the batch's only item shares its prefix with none
    return CallRows(
        batch={
            "id": frame.id,
            "tenant_id": tenant.id,
            "status": BatchStatus.IN_PROGRESS.value,
            "endpoint": prep.endpoint or prep.first.endpoint,
            "priority": prep.priority.value,
            "completion_window_s": int(prep.window_s),
            "window_s": prep.window_s,
            "offload": prep.offload.value,
            "route": prep.route.value,
            "origin": options.origin,
            "request_sha256": prep.fingerprint.hexdigest(),
            "key_id": options.key_id,
        },
        item=item,
        item_window_s=(item["deadline_at"] - now).total_seconds(),
    )


def _get_batch(session: Session, batch_id: str) -> Batch | None:
    if not BATCH_ID.fullmatch(batch_id):
        return None  # never sent to the database: it could not be stored anyway
    return session.get(Batch, batch_id)


def get_readable_batch(session: Session, tenant: Tenant, batch_id: str) -> Batch:
    """A batch the caller may read: its own, or any for an admin key."""
    batch = _get_batch(session, batch_id)
    if batch is None or (batch.tenant_id != tenant.id and not tenant.is_admin):
        raise NotFound(f"no batch {batch_id!r}")
    return batch


def get_owned_batch(session: Session, tenant: Tenant, batch_id: str) -> Batch:
    """A batch of the caller's own tenant, what it may change (admin keys: their own only)."""
    batch = _get_batch(session, batch_id)
    if batch is None or batch.tenant_id != tenant.id:
        raise NotFound(f"no batch {batch_id!r}")
    return batch


def request_counts(session: Session, batch: Batch) -> dict[str, int]:
    """Items per status, every status present (0 when none): a finished batch's from
    its totals (they cost the same however large the batch), an open one's counted."""
    if batch.finished_at is not None:
        rows = list(totals.batches_finished(session, [batch.id]).get(batch.id, {}).items())
    else:
        rows = [
            (status, n)
            for status, n in session.execute(
                select(Item.status, func.count())
                .where(Item.batch_id == batch.id)
                .group_by(Item.status)
            )
        ]
    counts = {s.value: 0 for s in ItemStatus}
    for status, n in rows:
        counts[status] = n
    counts["total"] = sum(counts.values())
    return counts


def _ts(value: dt.datetime | None) -> int | None:
    return int(value.timestamp()) if value else None


def describe(session: Session, batch: Batch) -> dict[str, Any]:
    """The batch as the API shows it: OpenAI's batch object, every field its SDK's
    ``Batch`` type has, with OpenAI's values; our own fields besides (``priority``,
    ``finished_at``, ``cancel_requested_at``, and the count of every item status in
    ``request_counts``), which the SDKs keep as extras."""
    counts = request_counts(session, batch)
    output_id, error_id = output_file_ids(batch, counts)
    finished = _ts(batch.finished_at)
    status = BatchStatus(batch.status)
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": None,
        "input_file_id": batch.input_file_id or "",
        "completion_window": format_duration(batch.completion_window_s),
        "status": batch.status,
        "output_file_id": output_id,
        "error_file_id": error_id,
        "created_at": _ts(batch.created_at),
        # Validated when stored: a batch is in progress from its creation.
        "in_progress_at": _ts(batch.created_at),
        "expires_at": _ts(batch.deadline_at),
        "finalizing_at": None,
        "completed_at": finished if status is BatchStatus.COMPLETED else None,
        "failed_at": None,
        "expired_at": finished if status is BatchStatus.EXPIRED else None,
        "cancelling_at": _ts(batch.cancel_requested_at),
        "cancelled_at": finished if status is BatchStatus.CANCELLED else None,
        "request_counts": {
            "total": counts["total"],
            "completed": counts[ItemStatus.SUCCEEDED],
            **{s.value: counts[s] for s in ItemStatus},
        },
        "metadata": batch.metadata_,
        "model": None,
        "usage": None,
        "priority": batch.priority,
        "offload": batch.offload,
        "route": batch.route,
        "cancel_requested_at": _ts(batch.cancel_requested_at),
        "finished_at": finished,
    }


def list_page(
    session: Session,
    tenant: Tenant,
    *,
    limit: int = 20,
    after: str | None = None,
    before: str | None = None,
    endpoint: str | None = None,
    max_limit: int = 100,
) -> tuple[list[Batch], bool]:
    """One page of the tenant's batches, newest first, and whether more follow.

    ``after`` is the last id of the previous page (older batches follow), ``before``
    the first id of the next page (newer ones, the page just before it).
    ``endpoint`` keeps one API's batches. One row beyond the page is read, so an
    exactly full last page says ``has_more = False``.
    """
    if not 1 <= limit <= max_limit:
        raise ValidationFailed(f"limit must be between 1 and {max_limit}", field="limit")
    # Synchronous calls are batches of one for the machinery, not in the tenant's list.
    query = select(Batch).where(Batch.tenant_id == tenant.id, listed_batch())
    if endpoint is not None:
        query = query.where(Batch.endpoint == endpoint)
    key = (Batch.created_at, Batch.id)
    for cursor, field in ((after, "after"), (before, "before")):
        if cursor is None:
            continue
        if not BATCH_ID.fullmatch(cursor):
            raise ValidationFailed(f"{field} must be a batch id", field=field)
        anchor = get_owned_batch(session, tenant, cursor)
        mark = (anchor.created_at, anchor.id)
        query = query.where(key < mark if field == "after" else key > mark)  # type: ignore[operator]
    if before is not None and after is None:  # the newest-first page that ends before it
        rows = list(session.scalars(query.order_by(*key).limit(limit + 1)))
        return list(reversed(rows[:limit])), len(rows) > limit
    query = query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
    rows = list(session.scalars(query))
    return rows[:limit], len(rows) > limit


def _rfc3339(value: dt.datetime | None) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value is not None else None


def describe_message_batch(
    session: Session, batch: Batch, results_url: str | None = None
) -> dict[str, Any]:
    """The batch as Anthropic's ``MessageBatch``. ``results_url`` (where the API serves
    the results) is given once the batch has ended."""
    counts = request_counts(session, batch)
    status = BatchStatus(batch.status)
    ended = batch.finished_at is not None and status in _FINISHED
    processing = (
        "ended"
        if ended
        else ("canceling" if batch.cancel_requested_at is not None else "in_progress")
    )
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": processing,
        "request_counts": {
            "processing": sum(counts[s] for s in OPEN),
            "succeeded": counts[ItemStatus.SUCCEEDED],
            "errored": counts[ItemStatus.FAILED],
            "canceled": counts[ItemStatus.CANCELLED],
            "expired": counts[ItemStatus.EXPIRED],
        },
        "created_at": _rfc3339(batch.created_at),
        "expires_at": _rfc3339(batch.deadline_at),
        "ended_at": _rfc3339(batch.finished_at) if ended else None,
        "cancel_initiated_at": _rfc3339(batch.cancel_requested_at),
        "archived_at": None,
        "results_url": results_url if ended else None,
    }


def list_batches(
    session: Session, tenant: Tenant, *, limit: int = 20, after: str | None = None
) -> list[Batch]:
    """The tenant's batches, newest first; ``after`` is the last id of the previous page."""
    return list_page(session, tenant, limit=limit, after=after)[0]


def refresh_status(session: Session, batch_id: str) -> str:
    """Finish a batch once none of its items is open; returns its status."""
    batch = session.get(Batch, batch_id, with_for_update=True)
    assert batch is not None
    if batch.finished_at is not None:
        return batch.status
    counts = {
        ItemStatus(status): n
        for status, n in session.execute(
            select(Item.status, func.count()).where(Item.batch_id == batch_id).group_by(Item.status)
        )
    }
    status = batch_status(counts, batch.cancel_requested_at is not None)
    batch.status = status.value
    if not any(n for s, n in counts.items() if s in OPEN):
        batch.finished_at = session.scalar(select(func.now()))
        if batch.priority != Priority.CALL.value:  # a call's caller is waiting on it
            announced = {s.value: counts.get(s, 0) for s in ItemStatus}
            announced["total"] = sum(counts.values())
            batch_notifications.announce(session, batch, announced)
    return batch.status


def keyed_batches(session: Session, tenant_name: str, key_prefix: str) -> list[tuple[str, str]]:
    """``(id, idempotency key)`` of the tenant's batches whose key starts with
    ``key_prefix`` (a nightly run's parts)."""
    rows = session.execute(
        select(Batch.id, Batch.idempotency_key)
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(
            Tenant.name == tenant_name,
            Batch.idempotency_key.startswith(key_prefix, autoescape=True),
        )
    )
    return [(batch_id, str(key)) for batch_id, key in rows]


def cancel_requested_among(session: Session, batch_ids: list[str]) -> set[str]:
    """Which of ``batch_ids`` have a cancel requested."""
    return set(
        session.scalars(
            select(Batch.id).where(Batch.id.in_(batch_ids), Batch.cancel_requested_at.is_not(None))
        )
    )


def unfinished_batch_ids(session: Session) -> list[str]:
    """Batches still open although none of their items is (the sweep closes them)."""
    return list(session.scalars(query("unfinished_batches")))


class Progress(StrEnum):
    """Where a batch stands after one of its items ended (:func:`close_if_done`)."""

    DONE = "done"  # nothing open: closed in this transaction
    TAIL = "tail"  # only items running elsewhere are open: check again after the commit
    OPEN = "open"  # items still wait to run: a later item will close the batch


_PROGRESS = text(
    """
    SELECT EXISTS (SELECT 1 FROM items
                   WHERE batch_id = :batch_id
                     AND status IN ('pending', 'offloaded', 'queued')) AS waiting,
           EXISTS (SELECT 1 FROM items
                   WHERE batch_id = :batch_id AND status = 'running') AS running
    """
)


def close_if_done(session: Session, batch_id: str) -> Progress:
    """In the transaction that ended one of the batch's items: close the batch when
    nothing of it is open.

    Two items ending at once each see the other still running (neither has
    committed), so neither may close the batch: both report ``TAIL``, and their
    callers check again after their commits (:func:`finish_if_done`); the later
    check sees both. A batch with items still waiting is left to a later item.
    """
    row = session.execute(_PROGRESS, {"batch_id": batch_id}).one()
    if row.waiting:
        return Progress.OPEN
    if row.running:
        return Progress.TAIL
    refresh_status(session, batch_id)
    return Progress.DONE


def finish_if_done(session: Session, batch_id: str) -> None:
    """Cheap check after an item ends: lock and finish the batch only if nothing is open."""
    has_open = session.scalar(
        select(exists().where(Item.batch_id == batch_id, Item.status.in_(OPEN_VALUES)))
    )
    if not has_open:
        refresh_status(session, batch_id)


def cancel(session: Session, tenant: Tenant, batch_id: str) -> Batch:
    """Cancel at once every item whose provider request has not been sent.

    After this commits, no new provider request starts for the batch (workers
    re-check the item row when they claim it and right before they send, see
    :func:`batchgen.store.items.claim_sent`). Calls already under way are told to stop by
    :func:`batchgen.worker.cancellation.announce` after the commit.
    """
    batch = get_owned_batch(session, tenant, batch_id)
    if batch.finished_at is not None:
        return batch
    now = session.scalar(select(func.now()))
    if batch.cancel_requested_at is None:
        batch.cancel_requested_at = now
    assert now is not None
    items.cancel_unsent(session, batch_id, now)
    refresh_status(session, batch_id)
    return batch


def error_codes(session: Session, batch_ids: list[str]) -> dict[str, dict[str, int]]:
    """Per batch, how many of its unsuccessful items ended with each error code (one
    grouped query; codes, never text)."""
    rows = session.execute(
        select(Item.batch_id, func.coalesce(Item.error_code, Item.status), func.count())
        .where(Item.batch_id.in_(batch_ids), Item.status.in_([s.value for s in ERROR_STATUSES]))
        .group_by(Item.batch_id, func.coalesce(Item.error_code, Item.status))
    )
    found: dict[str, dict[str, int]] = {}
    for batch_id, code, n in rows:
        found.setdefault(batch_id, {})[code] = n
    return found


def iter_results(session: Session, batch: Batch) -> Iterator[dict[str, Any]]:
    """Finished items in input order, in the OpenAI Batch output format."""
    query = (
        select(
            Item.id,
            Item.custom_id,
            Item.status,
            Item.error_code,
            Item.last_error,
            Result.response,
            Result.provider_request_id,
        )
        .outerjoin(Result, Result.item_id == Item.id)
        .where(Item.batch_id == batch.id, Item.status.in_([s.value for s in TERMINAL]))
        .order_by(Item.line_no)
        .execution_options(yield_per=1000)
    )
    for row in session.execute(query):
        if row.status == ItemStatus.SUCCEEDED and row.response is not None:
            yield {
                "id": f"batch_req_{row.id}",
                "custom_id": row.custom_id,
                "response": {
                    "status_code": 200,
                    "request_id": row.provider_request_id,
                    "body": row.response,
                },
                "error": None,
            }
        else:
            yield {
                "id": f"batch_req_{row.id}",
                "custom_id": row.custom_id,
                "response": None,
                "error": {"code": row.error_code or row.status, "message": row.last_error},
            }
