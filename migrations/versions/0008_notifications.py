"""batch-finished notifications

- batch_notifications: one row per finished batch and channel (a Celery task of the
  host's, a webhook, a host-process signal), written in the transaction that finishes
  the batch and delivered at least once, with its attempts.
- batches.on_finished / on_finished_queue (the task) and batches.webhook_url.
- tenants.webhook_url and tenants.webhook_secret (the signing secret).

Revision ID: 0008
Revises: 0007
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "batch_notifications",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("batch_id", sa.String(length=40), nullable=False),
        sa.Column("channel", sa.String(length=20), nullable=False),
        sa.Column("target", sa.String(length=2000), nullable=True),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("status", sa.String(length=20), server_default="pending", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("next_attempt_at", TZ, server_default=sa.func.now(), nullable=False),
        sa.Column("last_error", sa.String(length=200), nullable=True),
        sa.Column("created_at", TZ, server_default=sa.func.now(), nullable=False),
        sa.Column("delivered_at", TZ, nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_batch_notifications_batch_id_batches")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batch_notifications")),
        sa.UniqueConstraint(
            "batch_id", "channel", name=op.f("uq_batch_notifications_batch_id_channel")
        ),
    )
    op.create_index(
        "ix_batch_notifications_due",
        "batch_notifications",
        ["channel", "next_attempt_at"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.add_column("batches", sa.Column("on_finished", sa.String(length=200), nullable=True))
    op.add_column("batches", sa.Column("on_finished_queue", sa.String(length=200), nullable=True))
    op.add_column("batches", sa.Column("webhook_url", sa.String(length=2000), nullable=True))
    op.add_column("tenants", sa.Column("webhook_url", sa.String(length=2000), nullable=True))
    op.add_column("tenants", sa.Column("webhook_secret", sa.String(length=128), nullable=True))


def downgrade() -> None:
    op.drop_column("tenants", "webhook_secret")
    op.drop_column("tenants", "webhook_url")
    op.drop_column("batches", "webhook_url")
    op.drop_column("batches", "on_finished_queue")
    op.drop_column("batches", "on_finished")
    op.drop_index("ix_batch_notifications_due", table_name="batch_notifications")
    op.drop_table("batch_notifications")
