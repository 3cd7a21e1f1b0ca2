"""per-tenant file quotas

- tenants.max_files and tenants.max_file_bytes: a tenant's own bound on its uploads
  (count, and bytes in all); NULL: the deployment's BATCHGEN_TENANT_MAX_FILES and
  BATCHGEN_TENANT_MAX_FILE_BYTES.

Revision ID: 0011
Revises: 0010
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("max_files", sa.Integer(), nullable=True))
    op.add_column("tenants", sa.Column("max_file_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("tenants", "max_file_bytes")
    op.drop_column("tenants", "max_files")
