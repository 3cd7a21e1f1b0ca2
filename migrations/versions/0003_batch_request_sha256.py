"""batches.request_sha256: the fingerprint of the request an Idempotency-Key names

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("request_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("batches", "request_sha256")
