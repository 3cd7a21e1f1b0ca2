"""the token of the claim that marked an item sent

- items.claim_token: a random number each claim that marks an item sent writes
  (store.items.claim_sent). A worker whose claim's reply was lost hands back, and
  tells the sweep "never sent" about, that very claim: not a later claim of the same
  attempt number, and whenever the lost one committed (PostgreSQL may run a statement
  after its client has given up on it).

Revision ID: 0021g
Revises: 0020f
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021g"
down_revision: str | Sequence[str] | None = "0020f"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("items", sa.Column("claim_token", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("items", "claim_token")
