"""token kinds

- results, usage_ledger and tenant_daily_usage: cached_tokens, cache_write_tokens and
  reasoning_tokens, the parts of prompt_tokens / completion_tokens that the providers
  bill at their own prices (cached input, cache writes, reasoning output). Existing
  rows get 0: they were priced as plain input and output.

Revision ID: 0012
Revises: 0011
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("cached_tokens", "cache_write_tokens", "reasoning_tokens")
TABLES = {
    "results": sa.Integer,
    "usage_ledger": sa.Integer,
    "tenant_daily_usage": sa.BigInteger,
}


def upgrade() -> None:
    for table, kind in TABLES.items():
        for column in COLUMNS:
            op.add_column(table, sa.Column(column, kind(), server_default="0", nullable=False))


def downgrade() -> None:
    for table in TABLES:
        for column in COLUMNS:
            op.drop_column(table, column)
