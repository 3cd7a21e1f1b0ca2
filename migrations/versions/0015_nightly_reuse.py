"""incremental nightly runs

- nightly_products: per tenant, job and product, the request hash (SHA-256 of its
  canonical JSON) and text of its last description and the day it was described, and
  the request hash its latest run submitted (pending_sha256, pending_on).
- nightly_runs: a run (job and date) of an incremental job, recorded when it is first
  submitted; reused: how many products it served from their stored text.
- nightly_reused: those products, each with the text it was served (kept until a later
  run of the job has been collected).

Revision ID: 0015
Revises: 0014
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "nightly_products",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("job", sa.String(length=100), nullable=False),
        sa.Column("product_id", sa.String(length=512), nullable=False),
        sa.Column("request_sha256", sa.String(length=64), nullable=True),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("described_on", sa.Date(), nullable=True),
        sa.Column("pending_sha256", sa.String(length=64), nullable=True),
        sa.Column("pending_on", sa.Date(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_nightly_products_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "job", "product_id", name="pk_nightly_products"),
    )
    op.create_table(
        "nightly_runs",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("job", sa.String(length=100), nullable=False),
        sa.Column("run_date", sa.Date(), nullable=False),
        sa.Column("reused", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", TZ, server_default=sa.func.now(), nullable=False),
        sa.Column("collected_at", TZ, nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_nightly_runs_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "job", "run_date", name="pk_nightly_runs"),
    )
    op.create_table(
        "nightly_reused",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("job", sa.String(length=100), nullable=False),
        sa.Column("run_date", sa.Date(), nullable=False),
        sa.Column("product_id", sa.String(length=512), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("request_sha256", sa.String(length=64), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id", "job", "run_date"],
            ["nightly_runs.tenant_id", "nightly_runs.job", "nightly_runs.run_date"],
            name="fk_nightly_reused_tenant_id_nightly_runs",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "tenant_id", "job", "run_date", "product_id", name="pk_nightly_reused"
        ),
    )


def downgrade() -> None:
    op.drop_table("nightly_reused")
    op.drop_table("nightly_runs")
    op.drop_table("nightly_products")
