"""tenant_daily_usage in shards; items.rate_limited

- tenant_daily_usage gains a ``shard`` column in its primary key: an item's
  usage goes to shard ``item_id % 16``, so finishing items of one tenant no
  longer queue on one row lock; readers sum over the shards. Existing rows are
  shard 0.
- items.rate_limited counts the provider's 429s for an item: they are budget
  signals, not failures, and have a cap of their own.

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "tenant_daily_usage",
        sa.Column("shard", sa.SmallInteger(), server_default="0", nullable=False),
    )
    op.drop_constraint(op.f("pk_tenant_daily_usage"), "tenant_daily_usage", type_="primary")
    op.create_primary_key(
        op.f("pk_tenant_daily_usage"), "tenant_daily_usage", ["tenant_id", "day", "model", "shard"]
    )
    op.add_column(
        "items", sa.Column("rate_limited", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("items", "rate_limited")
    # Fold the shards back into one row per (tenant, day, model).
    op.execute(
        """
        CREATE TEMPORARY TABLE folded AS
        SELECT tenant_id, day, model, sum(requests) AS requests,
               sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens,
               sum(cost_usd) AS cost_usd
        FROM tenant_daily_usage GROUP BY tenant_id, day, model
        """
    )
    op.execute("DELETE FROM tenant_daily_usage")
    op.execute(
        "INSERT INTO tenant_daily_usage (tenant_id, day, model, requests, prompt_tokens, "
        "completion_tokens, cost_usd, shard) SELECT tenant_id, day, model, requests, "
        "prompt_tokens, completion_tokens, cost_usd, 0 FROM folded"
    )
    op.execute("DROP TABLE folded")
    op.drop_constraint(op.f("pk_tenant_daily_usage"), "tenant_daily_usage", type_="primary")
    op.create_primary_key(
        op.f("pk_tenant_daily_usage"), "tenant_daily_usage", ["tenant_id", "day", "model"]
    )
    op.drop_column("tenant_daily_usage", "shard")
