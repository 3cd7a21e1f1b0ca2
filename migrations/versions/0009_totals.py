"""totals kept off the hot path, and the indexes of the dispatcher's and the sweep's scans

- admitted_totals: items and estimated tokens admitted per model and tenant (added by
  each submit); back-filled from the items there are.
- finished_totals, batch_totals, latency_totals: finished items per model, tenant and
  status, per batch, and the results' latency histograms, rolled up from
  items.finished_at up to totals_watermark (one row; NULL: nothing rolled up yet, so
  the first roll-up reads the history once).
- ix_items_pending_by_model covers ready items only (not_before IS NULL);
  ix_items_deferred finds the deferred ones that are due; ix_items_unstarted_deadline
  serves the sweep's expiry; ix_items_finished_at the totals' tail;
  ix_batches_unfinished the open batches; ix_usage_ledger_waste the usage report's
  waste.

On a large items table the index builds take a while and block writes: run the
migration in a quiet moment.

Revision ID: 0009
Revises: 0008
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "admitted_totals",
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("items", sa.BigInteger(), nullable=False),
        sa.Column("tokens_est", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_admitted_totals_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("model", "tenant_id", name="pk_admitted_totals"),
    )
    op.create_table(
        "finished_totals",
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("items", sa.BigInteger(), nullable=False),
        sa.Column("tokens_est", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_finished_totals_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("model", "tenant_id", "status", name="pk_finished_totals"),
    )
    op.create_table(
        "batch_totals",
        sa.Column("batch_id", sa.String(length=40), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("items", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["batches.id"],
            name="fk_batch_totals_batch_id_batches",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("batch_id", "status", name="pk_batch_totals"),
    )
    op.create_table(
        "latency_totals",
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("metric", sa.String(length=20), nullable=False),
        sa.Column("le_ms", sa.Integer(), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.Column("sum_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("model", "metric", "le_ms", name="pk_latency_totals"),
    )
    op.create_table(
        "totals_watermark",
        sa.Column("id", sa.SmallInteger(), nullable=False),
        sa.Column("rolled_up_before", TZ, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_totals_watermark"),
    )
    op.execute("INSERT INTO totals_watermark (id, rolled_up_before) VALUES (1, NULL)")
    op.execute(
        "INSERT INTO admitted_totals (model, tenant_id, items, tokens_est) "
        "SELECT model, tenant_id, count(*), sum(prompt_tokens_est + max_tokens) "
        "FROM items GROUP BY model, tenant_id"
    )

    op.drop_index("ix_items_pending_by_model", table_name="items")
    op.create_index(
        "ix_items_pending_by_model",
        "items",
        ["model", "tenant_id", "priority_rank", "id"],
        postgresql_where=sa.text("status = 'pending' AND not_before IS NULL"),
    )
    op.create_index(
        "ix_items_deferred",
        "items",
        ["model", "not_before"],
        postgresql_where=sa.text("status = 'pending' AND not_before IS NOT NULL"),
    )
    op.create_index(
        "ix_items_unstarted_deadline",
        "items",
        ["deadline_at"],
        postgresql_where=sa.text("status IN ('pending', 'queued')"),
    )
    op.create_index(
        "ix_items_finished_at",
        "items",
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    op.create_index(
        "ix_batches_unfinished",
        "batches",
        ["created_at"],
        postgresql_where=sa.text("finished_at IS NULL"),
    )
    op.create_index(
        "ix_usage_ledger_waste",
        "usage_ledger",
        ["created_at"],
        postgresql_where=sa.text("waste_reason IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_usage_ledger_waste", table_name="usage_ledger")
    op.drop_index("ix_batches_unfinished", table_name="batches")
    op.drop_index("ix_items_finished_at", table_name="items")
    op.drop_index("ix_items_unstarted_deadline", table_name="items")
    op.drop_index("ix_items_deferred", table_name="items")
    op.drop_index("ix_items_pending_by_model", table_name="items")
    op.create_index(
        "ix_items_pending_by_model",
        "items",
        ["model", "tenant_id", "priority_rank", "id"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    for table in (
        "totals_watermark",
        "latency_totals",
        "batch_totals",
        "finished_totals",
        "admitted_totals",
    ):
        op.drop_table(table)
