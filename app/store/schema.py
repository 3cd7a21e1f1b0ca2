"""SQLAlchemy 2.0 models. Alembic (migrations/) is the one source of schema truth;
tests/integration/test_migrations.py proves the two agree."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Numeric,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from batchgen.domain.billing.budget_maths import Period
from batchgen.domain.formats.stream_usage import UsageSource
from batchgen.domain.lifecycle.status import BatchStatus, ItemStatus, JobStatus, Priority
from batchgen.domain.scheduling.routes import ItemRoute

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

USD = Numeric(20, 10)
DAILY_USAGE_SHARDS = 16
TZ = DateTime(timezone=True)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


# The batches a tenant's lists show (GET /v1/batches, the dashboard): a synchronous
# call is a batch of one for the machinery, never listed, and there may be millions of
# them. Written with its literal, in the lists' queries as in their partial indexes,
# so that the planner matches the indexes also in a generic (prepared) plan.
LISTED_BATCHES = f"priority <> '{Priority.CALL.value}'"


def one_of(
    column: str,
    statuses: type[ItemStatus]
    | type[BatchStatus]
    | type[JobStatus]
    | type[ItemRoute]
    | type[UsageSource]
    | type[Period],
) -> str:
    """A CHECK expression allowing exactly the enum's values (migration 0004)."""
    listed = ", ".join(f"'{s.value}'" for s in sorted(statuses, key=lambda s: s.value))
    return f"{column} IN ({listed})"


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    # Its API keys are rows of api_keys (migration 0019 moved the one key it had there).
    weight: Mapped[int] = mapped_column(Integer, server_default="1")
    max_pending_items: Mapped[int | None] = mapped_column(Integer)
    daily_token_quota: Mapped[int | None] = mapped_column(BigInteger)
    tokens_per_min: Mapped[int | None] = mapped_column(Integer)
    # Its own bounds on its uploads (count, bytes in all); NULL: the settings'
    # tenant_max_files and tenant_max_file_bytes (migration 0010).
    max_files: Mapped[int | None] = mapped_column(Integer)
    max_file_bytes: Mapped[int | None] = mapped_column(BigInteger)
    is_admin: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # Where the tenant's finished batches are announced, unless a batch names its own,
    # and the secret its webhook deliveries are signed with (migration 0008).
    webhook_url: Mapped[str | None] = mapped_column(String(2000))
    webhook_secret: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    # Suspended: none of its keys works (401) until it is resumed; its batches stay.
    revoked_at: Mapped[dt.datetime | None] = mapped_column(TZ)

    __table_args__ = (CheckConstraint("weight > 0", name="weight_positive"),)


class ApiKey(Base):
    """One of a tenant's API keys: only its SHA-256 is kept, and its first characters
    to tell it apart (batchgen.domain.keys; migration 0019)."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(16))
    # batches, calls, read, admin (batchgen.domain.keys.Scope)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(String(16)))
    # Its own requests per minute (None: only the tenant's limits), in Redis.
    requests_per_min: Mapped[int | None] = mapped_column(Integer)
    expires_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    # Written at most once a minute per key (batchgen.domain.keys.LAST_USED_EVERY_S).
    last_used_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    # The key this one was rotated from, if any.
    rotated_from: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (CheckConstraint("requests_per_min > 0", name="requests_per_min_positive"),)


class AuditEntry(Base):
    """One change made to tenants or keys: who, what, when, and the row before and
    after it (never a key's secret nor its hash)."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    # operator:<name> | django:<user> | cli:<os user> | tenant:<name>/key:<id> | python
    actor: Mapped[str] = mapped_column(String(300))
    # tenant.create, tenant.update, tenant.suspend, tenant.resume, key.create, ...
    action: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_id: Mapped[int | None] = mapped_column(BigInteger)
    before: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSONB)


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    status: Mapped[str] = mapped_column(String(20))
    endpoint: Mapped[str] = mapped_column(String(100))
    priority: Mapped[str] = mapped_column(String(20))
    completion_window_s: Mapped[int] = mapped_column(Integer)
    deadline_at: Mapped[dt.datetime] = mapped_column(TZ)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONB)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    # The uploaded file the batch was created from (POST /v1/batches with input_file_id).
    input_file_id: Mapped[str | None] = mapped_column(String(40))
    # auto | never | always: may its items go to the provider's Batch API
    # (batchgen.domain.scheduling.offload.OffloadMode)?
    offload: Mapped[str] = mapped_column(String(10), server_default="auto")
    # auto | standard | flex | batch: the routes its items may take
    # (batchgen.domain.scheduling.routes.RouteMode; migration 0016).
    route: Mapped[str] = mapped_column(String(10), server_default="auto")
    # Told when the batch ends: a Celery task of the host's (sent by name to its
    # queue), and a webhook (else the tenant's).
    on_finished: Mapped[str | None] = mapped_column(String(200))
    on_finished_queue: Mapped[str | None] = mapped_column(String(200))
    webhook_url: Mapped[str | None] = mapped_column(String(2000))
    # The host app (Flask, Django: its BATCHGEN_APP_ID) it was submitted through; None
    # from the standalone API. Its batch_finished signal fires there only (migration 0010).
    origin: Mapped[str | None] = mapped_column(String(200))
    # SHA-256 of the request that used the key
    # (batchgen.domain.formats.admission.RequestFingerprint):
    # the key replays this request only.
    request_sha256: Mapped[str | None] = mapped_column(String(64))
    # The API key it (a batch, or a call: a batch of one) was made with; None from the
    # Python API, the CLI and before migration 0019. Its ledger rows are that key's
    # usage. No foreign key: a key is never deleted, and each insert stays one lookup.
    key_id: Mapped[int | None] = mapped_column(BigInteger)
    total_items: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    cancel_requested_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    finished_at: Mapped[dt.datetime | None] = mapped_column(TZ)

    __table_args__ = (
        CheckConstraint(one_of("status", BatchStatus), name="status_known"),
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index("ix_batches_tenant_id_created_at", "tenant_id", "created_at"),
        # The open batches (the sweep's closing scan, the status view): a synchronous
        # call is a batch of its own, so batches grow with the history too.
        Index(
            "ix_batches_unfinished",
            "created_at",
            postgresql_where=text("finished_at IS NULL"),
        ),
        # Retention's scan: the batches finished longest ago first.
        Index(
            "ix_batches_finished_at",
            "finished_at",
            postgresql_where=text("finished_at IS NOT NULL"),
        ),
        # The lists, newest first (read backwards), of a tenant and of every tenant
        # (migration 0018): a page reads its rows, never the synchronous calls between.
        Index(
            "ix_batches_listed_by_tenant",
            "tenant_id",
            "created_at",
            "id",
            postgresql_where=text(LISTED_BATCHES),
        ),
        Index(
            "ix_batches_listed",
            "created_at",
            "id",
            postgresql_where=text(LISTED_BATCHES),
        ),
    )


def listed_batch() -> Any:
    """The lists' filter, :data:`LISTED_BATCHES` as a clause of a query on batches."""
    return text(f"batches.{LISTED_BATCHES}")


class File(Base):
    """An uploaded file (the OpenAI Files API), content and all, so every API host
    sees it; deleted by the sweep once ``expires_at`` passed."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    purpose: Mapped[str] = mapped_column(String(40))
    filename: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    line_count: Mapped[int] = mapped_column(Integer)
    # Kept uncompressed (storage EXTERNAL, migration 0013), so that a part of it is read
    # without the whole (store.files reads it in pieces); loaded only when read.
    content: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    expires_at: Mapped[dt.datetime | None] = mapped_column(TZ, index=True)

    __table_args__ = (Index("ix_files_tenant_id_created_at", "tenant_id", "created_at"),)


class Item(Base):
    __tablename__ = "items"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"))
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    line_no: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(String(512))
    model: Mapped[str] = mapped_column(String(200))
    # 0 = interactive, 1 = bulk: within a tenant, interactive work goes first.
    priority_rank: Mapped[int] = mapped_column(SmallInteger)
    # No statement looks into it: ANALYZE gathers no statistics of it (migration 0022).
    body: Mapped[dict[str, Any]] = mapped_column(JSONB)
    prompt_tokens_est: Mapped[int] = mapped_column(Integer)
    max_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(20))
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    # The provider's 429s for this item: budget signals, capped apart from attempts.
    rate_limited: Mapped[int] = mapped_column(Integer, server_default="0")
    # Attempts whose call failed on one deployment and went to another (migration
    # 0013): they use none of the failure attempts (the cap counts attempts - failovers).
    failovers: Mapped[int] = mapped_column(Integer, server_default="0")
    # The deployment the current attempt's call went to.
    deployment: Mapped[str | None] = mapped_column(String(64))
    # The route of its next call: standard, flex, or batch (a provider job's); the
    # flex calls the provider refused as busy (none a failure attempt); and the key of
    # the long prompt prefix it shares with others of its batch (migration 0016).
    route: Mapped[str] = mapped_column(String(10), server_default="standard")
    flex_refusals: Mapped[int] = mapped_column(Integer, server_default="0")
    prefix_key: Mapped[int | None] = mapped_column(BigInteger)
    not_before: Mapped[dt.datetime | None] = mapped_column(TZ)
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    deadline_at: Mapped[dt.datetime] = mapped_column(TZ)
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    queued_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    started_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    # When the provider request of the current attempt was sent; a cancel
    # ends running items not yet sent, and aborts the ones already sent.
    sent_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    # A random number each claim that marks the item sent writes (migration 0021): a
    # claim whose reply was lost is handed back, and told to the sweep, by it.
    claim_token: Mapped[int | None] = mapped_column(BigInteger)
    finished_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    error_code: Mapped[str | None] = mapped_column(String(64))
    last_error: Mapped[str | None] = mapped_column(Text)
    # The provider job an offloaded item is in (None: waiting for one). It stays set
    # when the item goes back online, so that it is never offloaded twice.
    job_id: Mapped[int | None] = mapped_column(ForeignKey("provider_jobs.id"))
    # Its place in the tenant's queue on its model, after the priority: a batch's items
    # are keyed from the tenant's dispatch clock at its submit (DispatchClock), so the
    # open batches of one priority take turns instead of waiting for each other.
    dispatch_key: Mapped[int] = mapped_column(BigInteger, server_default="0")

    __table_args__ = (
        CheckConstraint(one_of("status", ItemStatus), name="status_known"),
        CheckConstraint(one_of("route", ItemRoute), name="route_known"),
        # The offload planner's scan: offloaded items not yet in a job.
        Index(
            "ix_items_offload_waiting",
            "model",
            "batch_id",
            "id",
            postgresql_where=text("status = 'offloaded' AND job_id IS NULL"),
        ),
        UniqueConstraint("batch_id", "custom_id"),
        # A batch's items per status, in input order (its output and error files).
        Index("ix_items_batch_id_status_line_no", "batch_id", "status", "line_no"),
        # The dispatcher's scans: pending work ready to run, per model; the tenants that
        # have some (store.rounds reads them in ring order), and each one's items in
        # its order. Deferred items (not_before set) are apart: the dispatcher makes the
        # due ones ready (store.items.ready_due), so a million deferred items cost it
        # nothing.
        Index(
            "ix_items_pending_by_model",
            "model",
            "tenant_id",
            "priority_rank",
            "dispatch_key",
            "id",
            postgresql_where=text("status = 'pending' AND not_before IS NULL"),
        ),
        # Removing a provider job (retention) checks that no item still names it.
        Index("ix_items_job_id", "job_id", postgresql_where=text("job_id IS NOT NULL")),
        Index(
            "ix_items_deferred",
            "model",
            "not_before",
            postgresql_where=text("status = 'pending' AND not_before IS NOT NULL"),
        ),
        # The sweep's expiry scan: open unstarted items by deadline.
        Index(
            "ix_items_unstarted_deadline",
            "deadline_at",
            postgresql_where=text("status IN ('pending', 'queued')"),
        ),
        # The totals' tail (store.totals): items finished since the last roll-up.
        Index(
            "ix_items_finished_at",
            "finished_at",
            postgresql_where=text("finished_at IS NOT NULL"),
        ),
        # The sweep's scan: leases that may have run out.
        Index(
            "ix_items_active_lease",
            "lease_expires_at",
            postgresql_where=text("status IN ('queued', 'running')"),
        ),
        Index("ix_items_model_status", "model", "status"),
    )


class ProviderJob(Base):
    """A job of the provider's own Batch API holding some offloaded items of one batch
    (batchgen.worker.offload_jobs). Recorded with its items *before* the call that creates
    it; ``tag`` names it at the provider (its requests' ``custom_id`` prefix, and
    OpenAI's metadata), so a job whose creation answer was lost is found again."""

    __tablename__ = "provider_jobs"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tag: Mapped[str] = mapped_column(String(64), unique=True)
    model: Mapped[str] = mapped_column(String(200))
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"))
    status: Mapped[str] = mapped_column(String(20))
    provider_job_id: Mapped[str | None] = mapped_column(String(200), unique=True)
    item_count: Mapped[int] = mapped_column(Integer)
    # What the provider's enqueued-token limit counts of it (prompt + max_tokens).
    enqueued_tokens: Mapped[int] = mapped_column(BigInteger)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    # Still running at the provider then: cancelled there, its items run online.
    cutoff_at: Mapped[dt.datetime] = mapped_column(TZ)
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    submitted_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    next_poll_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    polls: Mapped[int] = mapped_column(Integer, server_default="0")
    cancel_sent_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    # Why it was cancelled at the provider: cutoff (ran late) or batch_cancelled.
    cancel_reason: Mapped[str | None] = mapped_column(String(32))
    finished_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    error_code: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        CheckConstraint(one_of("status", JobStatus), name="status_known"),
        Index("ix_provider_jobs_batch_id", "batch_id"),
        Index(
            "ix_provider_jobs_open",
            "model",
            postgresql_where=text("status IN ('creating', 'running', 'unconfirmed')"),
        ),
    )


class ProviderJobItem(Base):
    """Which items a provider job holds, and the attempt its row is for each of them
    (its ledger row's attempt): an item may move on (back online, or to another job)
    before the job's rows come back."""

    __tablename__ = "provider_job_items"

    job_id: Mapped[int] = mapped_column(ForeignKey("provider_jobs.id"), primary_key=True)
    item_id: Mapped[int] = mapped_column(ForeignKey("items.id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer)

    # Retention removes an item's rows (and the foreign key checks them) by item.
    __table_args__ = (Index("ix_provider_job_items_item_id", "item_id"),)


class BatchNotification(Base):
    """One announcement of a finished batch on one channel (batchgen.domain.notifications),
    written in the transaction that finishes the batch and delivered at least once."""

    __tablename__ = "batch_notifications"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"))
    channel: Mapped[str] = mapped_column(String(20))
    # The task name, the URL (the signal channel has none).
    target: Mapped[str | None] = mapped_column(String(2000))
    # What is announced (batchgen.domain.notifications.payload): ids, status, counts.
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # pending | sending (claimed; next_attempt_at is the lease's end) | delivered | failed
    status: Mapped[str] = mapped_column(String(20), server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    next_attempt_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    # Why the last attempt failed: a code (http_500, timeout, ...), never a body.
    last_error: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    delivered_at: Mapped[dt.datetime | None] = mapped_column(TZ)

    __table_args__ = (
        UniqueConstraint("batch_id", "channel"),
        Index(
            "ix_batch_notifications_due",
            "channel",
            "next_attempt_at",
            postgresql_where=text("status IN ('pending', 'sending')"),
        ),
    )


class Result(Base):
    __tablename__ = "results"

    item_id: Mapped[int] = mapped_column(ForeignKey("items.id"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"), index=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    attempt: Mapped[int] = mapped_column(Integer)
    # No statement looks into it: ANALYZE gathers no statistics of it (migration 0022).
    response: Mapped[dict[str, Any]] = mapped_column(JSONB)
    provider_request_id: Mapped[str | None] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    # The kinds of token in them, each billed at its own price (migration 0012).
    cached_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    cache_write_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    reasoning_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    cost_usd: Mapped[Decimal] = mapped_column(USD)
    upstream_latency_ms: Mapped[int] = mapped_column(Integer)
    queue_wait_ms: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


class UsageLedger(Base):
    """One row per provider call that may have been billed, wasted ones included."""

    __tablename__ = "usage_ledger"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    item_id: Mapped[int] = mapped_column(ForeignKey("items.id"))
    attempt: Mapped[int] = mapped_column(Integer)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"))
    model: Mapped[str] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    # The kinds of token in them, each billed at its own price (migration 0012).
    cached_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    cache_write_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    reasoning_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    cost_usd: Mapped[Decimal] = mapped_column(USD)
    # Set when the call produced no result of record (a duplicate run, a lost race).
    waste_reason: Mapped[str | None] = mapped_column(String(64))
    # online, or offline (a row of a provider job, at the batch price)
    route: Mapped[str] = mapped_column(String(10), server_default="online")
    # An offline row's price at the online prices (what offloading saved is the difference).
    online_cost_usd: Mapped[Decimal | None] = mapped_column(USD)
    # The deployment of the model that served the call (migration 0013; NULL: a row of
    # a provider's Batch API, or from before).
    deployment: Mapped[str | None] = mapped_column(String(64))
    # The price tier the call was billed at: standard, flex or batch (migration 0016).
    tier: Mapped[str] = mapped_column(String(10), server_default="standard")
    # provider: the tokens the provider reported; estimate: none came back (a lost
    # call), the row holds what the call reserved (migration 0017).
    usage_source: Mapped[str] = mapped_column(String(10), server_default="provider")
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (
        UniqueConstraint("item_id", "attempt"),
        CheckConstraint(one_of("usage_source", UsageSource), name="usage_source_known"),
        Index("ix_usage_ledger_tenant_id_created_at", "tenant_id", "created_at"),
        # Retention removes a batch's rows (and the foreign key checks them) by batch.
        Index("ix_usage_ledger_batch_id", "batch_id"),
        # The usage report's waste: the few rows with a reason, by day.
        Index(
            "ix_usage_ledger_waste",
            "created_at",
            postgresql_where=text("waste_reason IS NOT NULL"),
        ),
    )


class TenantDailyUsage(Base):
    """Per-tenant, per-day, per-model totals of the ledger, kept in the same transaction.

    In ``DAILY_USAGE_SHARDS`` rows (``shard = item_id % DAILY_USAGE_SHARDS``) so that
    one tenant's finishing items do not wait on one row lock; readers sum the shards.
    """

    __tablename__ = "tenant_daily_usage"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    # The deployment that served the calls ('': none, rows of a provider's Batch API,
    # and totals from before migration 0018 whose ledger rows were gone by then): the
    # usage by deployment reads these totals, not the ledger.
    deployment: Mapped[str] = mapped_column(String(64), primary_key=True, server_default="")
    shard: Mapped[int] = mapped_column(SmallInteger, primary_key=True, server_default="0")
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    # The kinds of token in them, each billed at its own price (migration 0012).
    cached_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cache_write_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cost_usd: Mapped[Decimal] = mapped_column(USD)
    # The part of it bought through the providers' Batch APIs, and what that saved
    # against the online prices (migration 0007).
    offline_requests: Mapped[int] = mapped_column(BigInteger, server_default="0")
    offline_prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    offline_completion_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    offline_cost_usd: Mapped[Decimal] = mapped_column(USD, server_default="0")
    saved_usd: Mapped[Decimal] = mapped_column(USD, server_default="0")
    # The part of it that was waste (ledger rows with a waste_reason; migration 0018).
    wasted_requests: Mapped[int] = mapped_column(BigInteger, server_default="0")
    wasted_cost_usd: Mapped[Decimal] = mapped_column(USD, server_default="0")


class AdmittedTotals(Base):
    """Items and estimated tokens ever admitted, per model and tenant: added in the
    submit's transaction (store.batches.store_batch). What is open is this less what
    has finished (store.totals), so admission never sums the backlog item by item."""

    __tablename__ = "admitted_totals"

    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    items: Mapped[int] = mapped_column(BigInteger)
    tokens_est: Mapped[int] = mapped_column(BigInteger)


class FinishedTotals(Base):
    """Finished items per model, tenant and status, rolled up off the hot path from
    ``items.finished_at`` up to ``totals_watermark`` (store.totals)."""

    __tablename__ = "finished_totals"

    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    status: Mapped[str] = mapped_column(String(20), primary_key=True)
    items: Mapped[int] = mapped_column(BigInteger)
    tokens_est: Mapped[int] = mapped_column(BigInteger)


class BatchTotals(Base):
    """A batch's finished items per status, rolled up with :class:`FinishedTotals`."""

    __tablename__ = "batch_totals"

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    status: Mapped[str] = mapped_column(String(20), primary_key=True)
    items: Mapped[int] = mapped_column(BigInteger)
    # The bytes of these items' lines in the batch's output file (succeeded) or error
    # file (the others), as store.files renders them; NULL: rolled up before the bytes
    # were counted (migration 0013), so the file's size is counted from its lines.
    bytes: Mapped[int | None] = mapped_column(BigInteger)


class LatencyTotals(Base):
    """The results' queue waits and upstream latencies per model, counted per histogram
    bucket (``le_ms``: the bucket's upper bound, ``LE_INF_MS`` for +Inf), rolled up
    with :class:`FinishedTotals`."""

    __tablename__ = "latency_totals"

    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    metric: Mapped[str] = mapped_column(String(20), primary_key=True)
    le_ms: Mapped[int] = mapped_column(Integer, primary_key=True)
    n: Mapped[int] = mapped_column(BigInteger)
    sum_ms: Mapped[int] = mapped_column(BigInteger)


class DispatchRing(Base):
    """Where a model's dispatch ring stands between rounds (batchgen.domain.scheduling.round_robin):
    the next round starts at the first tenant with ready work whose id is
    ``start_tenant_id`` or more; if that is this very tenant, ``left_items`` of its
    turn remain (its deficit)."""

    __tablename__ = "dispatch_ring"

    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    start_tenant_id: Mapped[int] = mapped_column(BigInteger)
    left_items: Mapped[int] = mapped_column(Integer)


class DispatchClock(Base):
    """A tenant's dispatch clock on a model: the largest ``items.dispatch_key`` released
    so far. A new batch's items are keyed from it (the first one clock + 1), so they
    take turns with the items the tenant's open batches have left, from now on."""

    __tablename__ = "dispatch_clocks"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    released_key: Mapped[int] = mapped_column(BigInteger)


class BudgetHold(Base):
    """Until when a tenant's own budget (its ``tokens_per_min``) turns its items away, as
    the budget said when it last deferred one: the dispatcher passes the tenant over
    until then, so it takes no place another tenant could use."""

    __tablename__ = "budget_holds"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    held_until: Mapped[dt.datetime] = mapped_column(TZ)


class MoneyBudget(Base):
    """A dollar budget of a tenant (``key_id`` NULL) or of one of its keys: a hard limit
    in micro-dollars per period and its soft thresholds (batchgen.domain.billing.budget_maths;
    migration 0020)."""

    __tablename__ = "money_budgets"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"))
    limit_micros: Mapped[int] = mapped_column(BigInteger)
    # day | month | total (batchgen.domain.billing.budget_maths.Period)
    period: Mapped[str] = mapped_column(String(10))
    # The IANA zone its days and months start in.
    time_zone: Mapped[str] = mapped_column(String(64), server_default="UTC")
    # Soft thresholds, per cent of the limit (an alert once each per period).
    thresholds_pct: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    updated_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (
        CheckConstraint("limit_micros >= 0", name="limit_not_negative"),
        CheckConstraint(one_of("period", Period), name="period_known"),
        Index(
            "uq_money_budgets_tenant",
            "tenant_id",
            unique=True,
            postgresql_where=text("key_id IS NULL"),
        ),
        Index(
            "uq_money_budgets_key",
            "key_id",
            unique=True,
            postgresql_where=text("key_id IS NOT NULL"),
        ),
    )


class TotalsWatermark(Base):
    """One row: items finished before ``rolled_up_before`` are in the rolled-up totals
    (None: nothing yet)."""

    __tablename__ = "totals_watermark"

    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    rolled_up_before: Mapped[dt.datetime | None] = mapped_column(TZ)


class NightlyProduct(Base):
    """A nightly job's product (batchgen.nightly, migration 0015): the request hash and
    text of its last description, and the request hash its latest run submitted."""

    __tablename__ = "nightly_products"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    job: Mapped[str] = mapped_column(String(100), primary_key=True)
    product_id: Mapped[str] = mapped_column(String(512), primary_key=True)
    # SHA-256 of the canonical JSON of the request that was described, with its text.
    request_sha256: Mapped[str | None] = mapped_column(String(64))
    description: Mapped[str | None] = mapped_column(Text)
    described_on: Mapped[dt.date | None] = mapped_column(Date)
    # The request the latest run submitted, and that run's date: only that run's
    # result becomes the description (an earlier run collected later does not).
    pending_sha256: Mapped[str | None] = mapped_column(String(64))
    pending_on: Mapped[dt.date | None] = mapped_column(Date)


class NightlyRun(Base):
    """A run (job and date) of an incremental nightly job, recorded once when it is
    first submitted: a second submit replays what it reused."""

    __tablename__ = "nightly_runs"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    job: Mapped[str] = mapped_column(String(100), primary_key=True)
    run_date: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    # Products served from their stored text (rows of nightly_reused until dropped).
    reused: Mapped[int] = mapped_column(Integer, server_default="0")
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    collected_at: Mapped[dt.datetime | None] = mapped_column(TZ)


class NightlyReused(Base):
    """A product a run served from its stored text: the text as it was then, so that a
    later run's result does not change this run's output."""

    __tablename__ = "nightly_reused"

    tenant_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    job: Mapped[str] = mapped_column(String(100), primary_key=True)
    run_date: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    product_id: Mapped[str] = mapped_column(String(512), primary_key=True)
    # Its place among the run's products (catalog order).
    position: Mapped[int] = mapped_column(Integer)
    request_sha256: Mapped[str] = mapped_column(String(64))
    description: Mapped[str] = mapped_column(Text)

    __table_args__ = (
        ForeignKeyConstraint(
            ["tenant_id", "job", "run_date"],
            ["nightly_runs.tenant_id", "nightly_runs.job", "nightly_runs.run_date"],
            ondelete="CASCADE",
        ),
    )
