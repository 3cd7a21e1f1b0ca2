"""reads flat in the history: batch lists by partial indexes, usage by deployment

- ix_batches_listed_by_tenant (tenant_id, created_at, id) and ix_batches_listed
  (created_at, id), both only of the batches that are not synchronous calls
  (``priority <> 'call'``): a tenant's ``GET /v1/batches`` and the dashboard read
  their page from them, never the calls stored between its rows.
- tenant_daily_usage.deployment ('' for none), in its primary key, and
  wasted_requests / wasted_cost_usd: the daily totals of each ledger row, kept in
  its statement, are per deployment too and count its waste, so
  ``GET /v1/usage?group_by=deployment`` reads them instead of the ledger. The totals
  there are split here by the ledger rows there are (what retention removed stays
  under '').

Stop every process of the release before (workers, dispatchers, beat, API) before
this migration: once the key is swapped, their statements that add to the totals
name the old key and fail, and with them the recording of answers.

The indexes are built concurrently (writes go on meanwhile), outside the migration's
transaction. A build cut short leaves an invalid index behind: drop it (``DROP INDEX
CONCURRENTLY``) before running the migration again.

Revision ID: 0018
Revises: 0017
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As in batchgen.store.schema.LISTED_BATCHES, frozen here: a migration never changes.
LISTED = sa.text("priority <> 'call'")
USD = sa.Numeric(precision=20, scale=10)
# What a ledger row adds to its day's totals, and the column it adds it to.
MEASURES = {
    "requests": "count(*)",
    "prompt_tokens": "sum(prompt_tokens)",
    "completion_tokens": "sum(completion_tokens)",
    "cost_usd": "sum(cost_usd)",
    "cached_tokens": "sum(cached_tokens)",
    "cache_write_tokens": "sum(cache_write_tokens)",
    "reasoning_tokens": "sum(reasoning_tokens)",
    "offline_requests": "count(*) FILTER (WHERE route = 'offline')",
    "offline_prompt_tokens": "COALESCE(sum(prompt_tokens) FILTER (WHERE route = 'offline'), 0)",
    "offline_completion_tokens": (
        "COALESCE(sum(completion_tokens) FILTER (WHERE route = 'offline'), 0)"
    ),
    "offline_cost_usd": "COALESCE(sum(cost_usd) FILTER (WHERE route = 'offline'), 0)",
    "saved_usd": (
        "COALESCE(sum(COALESCE(online_cost_usd, cost_usd) - cost_usd)"
        " FILTER (WHERE route = 'offline'), 0)"
    ),
}
WASTE = {
    "wasted_requests": "count(*) FILTER (WHERE waste_reason IS NOT NULL)",
    "wasted_cost_usd": "COALESCE(sum(cost_usd) FILTER (WHERE waste_reason IS NOT NULL), 0)",
}


# The new primary key's index, built before the swap takes it over (and its name).
NEW_KEY = "pk_tenant_daily_usage_0017"


def _adding(columns: list[str], rows: str) -> str:
    """An upsert of ``rows`` (a query of the key and ``columns``) into the totals,
    summed per key first, added to what the key has."""
    names = ", ".join(columns)
    sums = ", ".join(f"sum({c})" for c in columns)
    added = ", ".join(f"{c} = d.{c} + EXCLUDED.{c}" for c in columns)
    return f"""
        INSERT INTO tenant_daily_usage AS d (tenant_id, day, model, deployment, shard, {names})
        SELECT tenant_id, day, model, deployment, shard, {sums} FROM ({rows}) AS r
        GROUP BY tenant_id, day, model, deployment, shard
        ON CONFLICT (tenant_id, day, model, deployment, shard) DO UPDATE SET {added}
    """


def _split_by_deployment() -> str:
    """The ledger rows' totals move from '' to their deployment (in shard 0: readers sum
    the shards), and their waste is counted."""
    columns = [*MEASURES, *WASTE]
    ledger = ", ".join(f"{sql} AS {name}" for name, sql in {**MEASURES, **WASTE}.items())
    moved_in = ", ".join(columns)
    moved_out = ", ".join([*(f"-{c}" for c in MEASURES), *("0" for _ in WASTE)])
    rows = f"""
        WITH l AS (
            SELECT tenant_id, CAST(timezone('UTC', created_at) AS date) AS day, model,
                   COALESCE(deployment, '') AS deployment, 0 AS shard, {ledger}
            FROM usage_ledger GROUP BY 1, 2, 3, 4
        )
        SELECT tenant_id, day, model, deployment, shard, {moved_in} FROM l
        UNION ALL
        SELECT tenant_id, day, model, '', shard, {moved_out} FROM l
    """
    return _adding(columns, rows)


def upgrade() -> None:
    # Each step may be run again after a migration cut short (the columns and indexes
    # are committed before the swap): none fails on what an earlier run left.
    for column in (
        "deployment varchar(64) NOT NULL DEFAULT ''",
        "wasted_requests bigint NOT NULL DEFAULT 0",
        "wasted_cost_usd numeric(20, 10) NOT NULL DEFAULT 0",
    ):
        op.execute(f"ALTER TABLE tenant_daily_usage ADD COLUMN IF NOT EXISTS {column}")
    # The indexes are built CONCURRENTLY, outside the migration's transaction: on a
    # long history a plain build would block every submit and every recorded answer.
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_batches_listed_by_tenant",
            "batches",
            ["tenant_id", "created_at", "id"],
            postgresql_where=LISTED,
            postgresql_concurrently=True,
            if_not_exists=True,
        )
        op.create_index(
            "ix_batches_listed",
            "batches",
            ["created_at", "id"],
            postgresql_where=LISTED,
            postgresql_concurrently=True,
            if_not_exists=True,
        )
        op.create_index(
            NEW_KEY,
            "tenant_daily_usage",
            ["tenant_id", "day", "model", "deployment", "shard"],
            unique=True,
            postgresql_concurrently=True,
            if_not_exists=True,
        )
    # The swap of the key and the split in one transaction: the swap locks the totals
    # until the split is committed, so no row recorded meanwhile is split again. Its
    # index is renamed by the swap: gone, the swap and the split were committed by an
    # earlier run.
    if op.get_bind().scalar(sa.text(f"SELECT to_regclass('{NEW_KEY}')")) is None:
        return
    op.execute(
        "ALTER TABLE tenant_daily_usage DROP CONSTRAINT pk_tenant_daily_usage, "
        f"ADD CONSTRAINT pk_tenant_daily_usage PRIMARY KEY USING INDEX {NEW_KEY}"
    )
    op.execute(_split_by_deployment())


def downgrade() -> None:
    columns = list(MEASURES)
    op.execute(
        f"""
        WITH folded AS (
            DELETE FROM tenant_daily_usage WHERE deployment <> '' RETURNING *
        )
        {
            _adding(
                columns,
                "SELECT tenant_id, day, model, '' AS deployment, shard, "
                + ", ".join(columns)
                + " FROM folded",
            )
        }
        """
    )
    op.execute(
        "ALTER TABLE tenant_daily_usage DROP CONSTRAINT pk_tenant_daily_usage, "
        "ADD CONSTRAINT pk_tenant_daily_usage PRIMARY KEY (tenant_id, day, model, shard)"
    )
    op.drop_column("tenant_daily_usage", "wasted_cost_usd")
    op.drop_column("tenant_daily_usage", "wasted_requests")
    op.drop_column("tenant_daily_usage", "deployment")
    op.drop_index("ix_batches_listed", table_name="batches", postgresql_where=LISTED)
    op.drop_index("ix_batches_listed_by_tenant", table_name="batches", postgresql_where=LISTED)
