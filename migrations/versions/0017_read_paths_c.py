"""reads flat in the history: the batch lists skip synchronous calls by an index

- ix_batches_listed_by_tenant (tenant_id, created_at, id) and ix_batches_listed
  (created_at, id), both only of the batches that are not synchronous calls
  (``priority <> 'call'``): a tenant's ``GET /v1/batches`` and the dashboard read
  their page from them, never the calls stored between its rows.

The indexes are built concurrently (writes go on meanwhile), outside the migration's
transaction. A build cut short leaves an invalid index behind: drop it (``DROP INDEX
CONCURRENTLY``) before running the migration again.

Revision ID: 0017
Revises: 0016
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As in batchgen.store.schema.LISTED_BATCHES, frozen here: a migration never changes.
LISTED = sa.text("priority <> 'call'")


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_batches_listed_by_tenant",
            "batches",
            ["tenant_id", "created_at", "id"],
            postgresql_where=LISTED,
            postgresql_concurrently=True,
        )
        op.create_index(
            "ix_batches_listed",
            "batches",
            ["created_at", "id"],
            postgresql_where=LISTED,
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    op.drop_index("ix_batches_listed", table_name="batches", postgresql_where=LISTED)
    op.drop_index("ix_batches_listed_by_tenant", table_name="batches", postgresql_where=LISTED)
