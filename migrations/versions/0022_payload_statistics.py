"""no planner statistics for the payload columns

- items.body and results.response: statistics target 0. No statement filters,
  joins or sorts on a request's body or an answer's JSON, so the planner never reads
  their statistics; computing them (the jsonb values of up to 30 000 sampled rows
  compared and sorted) was about half of each ANALYZE of these two tables, the largest
  of the schema, which autovacuum runs as they grow (items: 60 -> 24-32 ms for 10 000
  rows; results: 28 -> 15-20 ms).

Revision ID: 0022h
Revises: 0021g
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0022h"
down_revision: str | Sequence[str] | None = "0021g"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column): the payloads that no statement looks into.
PAYLOADS = (("items", "body"), ("results", "response"))


def upgrade() -> None:
    for table, column in PAYLOADS:
        op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} SET STATISTICS 0")


def downgrade() -> None:
    for table, column in PAYLOADS:
        op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} SET STATISTICS -1")
