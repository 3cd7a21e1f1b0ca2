"""costs flat in tenants and history: the dispatch ring, retention's indexes, file sizes

- dispatch_ring: where each model's deficit round robin stands between rounds (the
  next tenant, and what is left of its turn); dispatch_clocks: each tenant's dispatch
  clock per model. items.dispatch_key orders a tenant's items after their priority,
  keyed from its clock at submit, so its open batches of one priority take turns
  (existing items get 0: they keep their order by id, ahead of new batches).
- ix_items_pending_by_model takes dispatch_key before id (the order a tenant's items
  are released in); ix_items_batch_id_status becomes ix_items_batch_id_status_line_no
  (a batch's output and error files in input order, read from the index).
- Retention's scans: ix_batches_finished_at, ix_usage_ledger_batch_id,
  ix_provider_job_items_item_id, ix_items_job_id (the foreign key checks of its
  deletes read them too).
- batch_totals.bytes: the size of the batch's output and error files, rolled up with
  the counts (NULL for what was rolled up before: those sizes are counted from the
  lines when asked).
- files.content is stored uncompressed (EXTERNAL), so that a batch is created from an
  upload read in pieces; uploads stored before stay compressed (read whole per piece).

On a large items table the index builds take a while; they are built concurrently
(writes go on meanwhile), outside the migration's transaction. A build cut short
leaves an invalid index behind: drop it (``DROP INDEX CONCURRENTLY``) before running
the migration again.

Revision ID: 0014
Revises: 0013
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

READY = sa.text("status = 'pending' AND not_before IS NULL")


def upgrade() -> None:
    op.create_table(
        "dispatch_ring",
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("start_tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("left_items", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("model", name="pk_dispatch_ring"),
    )
    op.create_table(
        "dispatch_clocks",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("released_key", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_dispatch_clocks_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "model", name="pk_dispatch_clocks"),
    )
    op.add_column(
        "items", sa.Column("dispatch_key", sa.BigInteger(), server_default="0", nullable=False)
    )
    # The indexes are built CONCURRENTLY, outside the migration's transaction: on a
    # long history the build takes minutes, and a plain build would block every write
    # to items (the dispatcher, the workers) for all of it. The dispatcher's index is
    # built under another name first and swapped in, so dispatch never lacks one.
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_items_pending_by_model_0014",
            "items",
            ["model", "tenant_id", "priority_rank", "dispatch_key", "id"],
            postgresql_where=READY,
            postgresql_concurrently=True,
        )
        op.drop_index("ix_items_pending_by_model", table_name="items", postgresql_concurrently=True)
        op.execute("ALTER INDEX ix_items_pending_by_model_0014 RENAME TO ix_items_pending_by_model")
        op.create_index(
            "ix_items_batch_id_status_line_no",
            "items",
            ["batch_id", "status", "line_no"],
            postgresql_concurrently=True,
        )
        op.drop_index("ix_items_batch_id_status", table_name="items", postgresql_concurrently=True)
        op.create_index(
            "ix_items_job_id",
            "items",
            ["job_id"],
            postgresql_where=sa.text("job_id IS NOT NULL"),
            postgresql_concurrently=True,
        )
        op.create_index(
            "ix_batches_finished_at",
            "batches",
            ["finished_at"],
            postgresql_where=sa.text("finished_at IS NOT NULL"),
            postgresql_concurrently=True,
        )
        op.create_index(
            "ix_usage_ledger_batch_id",
            "usage_ledger",
            ["batch_id"],
            postgresql_concurrently=True,
        )
        op.create_index(
            "ix_provider_job_items_item_id",
            "provider_job_items",
            ["item_id"],
            postgresql_concurrently=True,
        )
    op.add_column("batch_totals", sa.Column("bytes", sa.BigInteger(), nullable=True))
    op.execute("ALTER TABLE files ALTER COLUMN content SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.execute("ALTER TABLE files ALTER COLUMN content SET STORAGE EXTENDED")
    op.drop_column("batch_totals", "bytes")
    op.drop_index("ix_provider_job_items_item_id", table_name="provider_job_items")
    op.drop_index("ix_usage_ledger_batch_id", table_name="usage_ledger")
    op.drop_index(
        "ix_batches_finished_at",
        table_name="batches",
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    op.drop_index(
        "ix_items_job_id", table_name="items", postgresql_where=sa.text("job_id IS NOT NULL")
    )
    op.create_index("ix_items_batch_id_status", "items", ["batch_id", "status"])
    op.drop_index("ix_items_batch_id_status_line_no", table_name="items")
    op.drop_index("ix_items_pending_by_model", table_name="items")
    op.create_index(
        "ix_items_pending_by_model",
        "items",
        ["model", "tenant_id", "priority_rank", "id"],
        postgresql_where=READY,
    )
    op.drop_column("items", "dispatch_key")
    op.drop_table("dispatch_clocks")
    op.drop_table("dispatch_ring")
