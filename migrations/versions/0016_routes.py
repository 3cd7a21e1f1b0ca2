"""routes by deadline, prompt-cache keys

- batches.route: the batch's ``route`` option (auto, standard, flex, batch).
- items.route: the route of the item's next call (standard, flex, or batch for an
  item waiting for or in a provider job); the items offloaded before this revision
  are ``batch``.
- items.flex_refusals: the flex calls the provider refused as busy (429 "resource
  unavailable"); none of them is a failure attempt.
- items.prefix_key: a hash of the long prompt prefix the item shares with others of
  its batch (the dispatcher releases a key's items together; Anthropic calls mark the
  prefix for the provider's cache); NULL when there is none.
- usage_ledger.tier: the price tier of the call (standard, flex, batch); the
  offline rows before this revision are ``batch``.

Revision ID: 0016
Revises: 0015
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "batches", sa.Column("route", sa.String(10), server_default="auto", nullable=False)
    )
    op.add_column(
        "items", sa.Column("route", sa.String(10), server_default="standard", nullable=False)
    )
    op.add_column(
        "items", sa.Column("flex_refusals", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column("items", sa.Column("prefix_key", sa.BigInteger(), nullable=True))
    op.create_check_constraint(
        op.f("ck_items_route_known"), "items", "route IN ('batch', 'flex', 'standard')"
    )
    op.execute("UPDATE items SET route = 'batch' WHERE status = 'offloaded'")
    op.add_column(
        "usage_ledger",
        sa.Column("tier", sa.String(10), server_default="standard", nullable=False),
    )
    op.execute("UPDATE usage_ledger SET tier = 'batch' WHERE route = 'offline'")


def downgrade() -> None:
    op.drop_column("usage_ledger", "tier")
    op.drop_constraint(op.f("ck_items_route_known"), "items", type_="check")
    op.drop_column("items", "prefix_key")
    op.drop_column("items", "flex_refusals")
    op.drop_column("items", "route")
    op.drop_column("batches", "route")
