"""budget holds, where a ledger row's usage came from

- budget_holds: until when a tenant's own budget (its tokens_per_min) turns its items
  away, as the budget said when it last deferred one; the dispatcher passes the tenant
  over until then (batchgen.domain.scheduling.round_robin).
- usage_ledger.usage_source: ``provider`` (the tokens the provider reported) or
  ``estimate`` (a lost call whose usage never came back: what it reserved); the lost
  calls' rows before this revision are ``estimate`` (they held the prompt estimate),
  the others ``provider``.

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
    op.add_column(
        "usage_ledger",
        sa.Column("usage_source", sa.String(10), server_default="provider", nullable=False),
    )
    op.create_check_constraint(
        op.f("ck_usage_ledger_usage_source_known"),
        "usage_ledger",
        "usage_source IN ('estimate', 'provider')",
    )
    # Only the few waste rows (the partial index ix_usage_ledger_waste finds them).
    op.execute(
        "UPDATE usage_ledger SET usage_source = 'estimate' "
        "WHERE waste_reason IN ('worker_lost', 'superseded_in_flight')"
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_usage_ledger_usage_source_known"), "usage_ledger", type_="check")
    op.drop_column("usage_ledger", "usage_source")
    op.drop_table("budget_holds")
