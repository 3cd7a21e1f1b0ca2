"""host-app origin of a batch, and notifications being sent under a lease

- batches.origin: the id of the host app (Flask, Django) a batch was submitted
  through, NULL for the standalone API; a host's batch_finished signal fires only for
  its own batches.
- batch_notifications.status may be 'sending' (claimed for one delivery; its
  next_attempt_at is then the lease's end, after which it is due again), so the due
  index covers both.

Revision ID: 0010
Revises: 0009
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("origin", sa.String(length=200), nullable=True))
    op.drop_index("ix_batch_notifications_due", table_name="batch_notifications")
    op.create_index(
        "ix_batch_notifications_due",
        "batch_notifications",
        ["channel", "next_attempt_at"],
        postgresql_where=sa.text("status IN ('pending', 'sending')"),
    )
    # Signals of batches with no host app are never fired: drop the ones waiting.
    op.execute(
        "DELETE FROM batch_notifications WHERE channel = 'signal' AND status = 'pending'"
    )


def downgrade() -> None:
    op.execute("UPDATE batch_notifications SET status = 'pending' WHERE status = 'sending'")
    op.drop_index("ix_batch_notifications_due", table_name="batch_notifications")
    op.create_index(
        "ix_batch_notifications_due",
        "batch_notifications",
        ["channel", "next_attempt_at"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.drop_column("batches", "origin")
