"""provider jobs: offloading bulk items to the providers' own Batch APIs

- provider_jobs: one row per job of a provider's Batch API, written with its items
  before the call that creates it; provider_job_items: which items it holds, and
  the attempt its row is for each.
- items.status may be ``offloaded`` (waiting for, or in, a provider job);
  items.job_id names the job.
- batches.offload: ``auto`` (the default), ``never`` or ``always``.
- usage_ledger.route (``online`` / ``offline``) and usage_ledger.online_cost_usd
  (an offline row at the online prices: what offloading saved); tenant_daily_usage
  keeps the offline part of its totals and what it saved beside them.

Revision ID: 0007
Revises: 0006
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here, as of this revision (batchgen.domain.lifecycle.status).
ITEM_STATUSES_0004 = ("cancelled", "expired", "failed", "pending", "queued", "running", "succeeded")
ITEM_STATUSES = tuple(sorted((*ITEM_STATUSES_0004, "offloaded")))
JOB_STATUSES = ("abandoned", "creating", "ended", "failed", "running", "unconfirmed")
USD = sa.Numeric(20, 10)
DAILY_OFFLINE_COUNTS = ("offline_requests", "offline_prompt_tokens", "offline_completion_tokens")
DAILY_OFFLINE_USD = ("offline_cost_usd", "saved_usd")
TZ = sa.DateTime(timezone=True)


def _in(values: tuple[str, ...]) -> str:
    return "status IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def upgrade() -> None:
    op.create_table(
        "provider_jobs",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("tag", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("batch_id", sa.String(length=40), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("provider_job_id", sa.String(length=200), nullable=True),
        sa.Column("item_count", sa.Integer(), nullable=False),
        sa.Column("enqueued_tokens", sa.BigInteger(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("cutoff_at", TZ, nullable=False),
        sa.Column("created_at", TZ, server_default=sa.func.now(), nullable=False),
        sa.Column("submitted_at", TZ, nullable=True),
        sa.Column("next_poll_at", TZ, nullable=True),
        sa.Column("polls", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cancel_sent_at", TZ, nullable=True),
        sa.Column("cancel_reason", sa.String(length=32), nullable=True),
        sa.Column("finished_at", TZ, nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.CheckConstraint(_in(JOB_STATUSES), name=op.f("ck_provider_jobs_status_known")),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_provider_jobs_batch_id_batches")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_provider_jobs")),
        sa.UniqueConstraint("tag", name=op.f("uq_provider_jobs_tag")),
        sa.UniqueConstraint("provider_job_id", name=op.f("uq_provider_jobs_provider_job_id")),
    )
    op.create_index("ix_provider_jobs_batch_id", "provider_jobs", ["batch_id"])
    op.create_index(
        "ix_provider_jobs_open",
        "provider_jobs",
        ["model"],
        postgresql_where=sa.text("status IN ('creating', 'running', 'unconfirmed')"),
    )
    op.create_table(
        "provider_job_items",
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("item_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["provider_jobs.id"], name=op.f("fk_provider_job_items_job_id_provider_jobs")
        ),
        sa.ForeignKeyConstraint(
            ["item_id"], ["items.id"], name=op.f("fk_provider_job_items_item_id_items")
        ),
        sa.PrimaryKeyConstraint("job_id", "item_id", name=op.f("pk_provider_job_items")),
    )
    op.add_column("items", sa.Column("job_id", sa.BigInteger(), nullable=True))
    op.create_foreign_key(
        op.f("fk_items_job_id_provider_jobs"), "items", "provider_jobs", ["job_id"], ["id"]
    )
    op.create_index(
        "ix_items_offload_waiting",
        "items",
        ["model", "batch_id", "id"],
        postgresql_where=sa.text("status = 'offloaded' AND job_id IS NULL"),
    )
    op.drop_constraint(op.f("ck_items_status_known"), "items", type_="check")
    op.create_check_constraint(op.f("ck_items_status_known"), "items", _in(ITEM_STATUSES))
    op.add_column(
        "batches", sa.Column("offload", sa.String(length=10), server_default="auto", nullable=False)
    )
    op.add_column(
        "usage_ledger",
        sa.Column("route", sa.String(length=10), server_default="online", nullable=False),
    )
    op.add_column("usage_ledger", sa.Column("online_cost_usd", USD, nullable=True))
    for column in DAILY_OFFLINE_COUNTS:
        op.add_column(
            "tenant_daily_usage",
            sa.Column(column, sa.BigInteger(), server_default="0", nullable=False),
        )
    for column in DAILY_OFFLINE_USD:
        op.add_column(
            "tenant_daily_usage", sa.Column(column, USD, server_default="0", nullable=False)
        )


def downgrade() -> None:
    offloaded = op.get_bind().scalar(sa.text("SELECT count(*) FROM items WHERE status = 'offloaded'"))
    if offloaded:
        raise RuntimeError(
            f"{offloaded} items are offloaded to provider jobs; let them finish before downgrading"
        )
    for column in (*DAILY_OFFLINE_USD, *DAILY_OFFLINE_COUNTS):
        op.drop_column("tenant_daily_usage", column)
    op.drop_column("usage_ledger", "online_cost_usd")
    op.drop_column("usage_ledger", "route")
    op.drop_column("batches", "offload")
    op.drop_constraint(op.f("ck_items_status_known"), "items", type_="check")
    op.create_check_constraint(op.f("ck_items_status_known"), "items", _in(ITEM_STATUSES_0004))
    op.drop_index("ix_items_offload_waiting", table_name="items")
    op.drop_constraint(op.f("fk_items_job_id_provider_jobs"), "items", type_="foreignkey")
    op.drop_column("items", "job_id")
    op.drop_table("provider_job_items")
    op.drop_index("ix_provider_jobs_open", table_name="provider_jobs")
    op.drop_index("ix_provider_jobs_batch_id", table_name="provider_jobs")
    op.drop_table("provider_jobs")
