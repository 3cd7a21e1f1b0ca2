"""deployment pools

- usage_ledger.deployment: the deployment of its model that served the call (a model
  that declares none has one, "default"); NULL for rows of the providers' Batch APIs
  and for rows written before this revision.
- items.deployment: the deployment the current attempt's call went to (the sweep
  ledgers a lost call against it).
- items.failovers: attempts whose call failed on one deployment and went to another;
  they use none of the item's failure attempts (the attempt cap counts attempts minus
  failovers), while each keeps its own attempt number (one ledger row per call).

Revision ID: 0013
Revises: 0012
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage_ledger", sa.Column("deployment", sa.String(64), nullable=True))
    op.add_column("items", sa.Column("deployment", sa.String(64), nullable=True))
    op.add_column(
        "items", sa.Column("failovers", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("items", "failovers")
    op.drop_column("items", "deployment")
    op.drop_column("usage_ledger", "deployment")
