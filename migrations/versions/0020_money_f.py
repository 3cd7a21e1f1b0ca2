"""dollar budgets of tenants and of their keys

- money_budgets: a hard limit in micro-dollars per period (day, month or total, in a
  named time zone) and soft thresholds, of a tenant (key_id NULL) or of one API key.

Revision ID: 0020f
Revises: 0019e
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0020f"
down_revision: str | Sequence[str] | None = "0019e"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "money_budgets",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("key_id", sa.BigInteger(), nullable=True),
        sa.Column("limit_micros", sa.BigInteger(), nullable=False),
        sa.Column("period", sa.String(length=10), nullable=False),
        sa.Column("time_zone", sa.String(length=64), server_default="UTC", nullable=False),
        sa.Column("thresholds_pct", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column("created_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("limit_micros >= 0", name=op.f("ck_money_budgets_limit_not_negative")),
        sa.CheckConstraint(
            "period IN ('day', 'month', 'total')", name=op.f("ck_money_budgets_period_known")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_money_budgets_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["key_id"], ["api_keys.id"], name=op.f("fk_money_budgets_key_id_api_keys")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_money_budgets")),
    )
    op.create_index(
        "uq_money_budgets_tenant",
        "money_budgets",
        ["tenant_id"],
        unique=True,
        postgresql_where=sa.text("key_id IS NULL"),
    )
    op.create_index(
        "uq_money_budgets_key",
        "money_budgets",
        ["key_id"],
        unique=True,
        postgresql_where=sa.text("key_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("uq_money_budgets_key", table_name="money_budgets")
    op.drop_index("uq_money_budgets_tenant", table_name="money_budgets")
    op.drop_table("money_budgets")
