"""budget holds

- budget_holds: until when a tenant's own budget (its tokens_per_min) turns its items
  away, as the budget said when it last deferred one; the dispatcher passes the tenant
  over until then (batchgen.domain.round_robin).

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


def upgrade() -> None:
    op.create_table(
        "budget_holds",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("held_until", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_budget_holds_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("tenant_id", name="pk_budget_holds"),
    )


def downgrade() -> None:
    op.drop_table("budget_holds")
