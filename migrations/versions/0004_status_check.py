"""items.status and batches.status: only the values of batchgen.domain.lifecycle.status

Existing rows are checked first: a row holding a value the enum does not know
stops the upgrade with the value and how many rows hold it, so nothing is
silently rewritten.

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here, as of this revision (batchgen.domain.lifecycle.status.ItemStatus / BatchStatus).
ITEM_STATUSES = ("cancelled", "expired", "failed", "pending", "queued", "running", "succeeded")
BATCH_STATUSES = ("cancelled", "cancelling", "completed", "expired", "in_progress")


def _in(values: tuple[str, ...]) -> str:
    return "status IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def _refuse_unknown(table: str, values: tuple[str, ...]) -> None:
    rows = op.get_bind().execute(
        sa.text(
            f"SELECT status, count(*) FROM {table} WHERE NOT ({_in(values)}) GROUP BY status"
        )
    ).all()
    if rows:
        found = ", ".join(f"{status!r}: {n} rows" for status, n in rows)
        raise RuntimeError(f"{table}.status holds values batchgen does not know ({found})")


def upgrade() -> None:
    _refuse_unknown("items", ITEM_STATUSES)
    _refuse_unknown("batches", BATCH_STATUSES)
    op.create_check_constraint(op.f("ck_items_status_known"), "items", _in(ITEM_STATUSES))
    op.create_check_constraint(op.f("ck_batches_status_known"), "batches", _in(BATCH_STATUSES))


def downgrade() -> None:
    op.drop_constraint(op.f("ck_batches_status_known"), "batches", type_="check")
    op.drop_constraint(op.f("ck_items_status_known"), "items", type_="check")
