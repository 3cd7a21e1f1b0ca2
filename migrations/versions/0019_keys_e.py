"""many API keys per tenant, the audit log, the key of each batch and call

- api_keys: a tenant's keys (hash, shown prefix, name, scopes, expiry, revocation,
  last use, requests per minute). Each tenant's one key moves there as it is (its
  hash and prefix, named "default", with every scope, revoked if it was), so the
  keys in use keep working; tenants.key_hash and key_prefix go.
- tenants.revoked_at now means the tenant is suspended (none of its keys works).
- audit_log: every change made to tenants and keys, who made it, before and after.
- batches.key_id: the key a batch or a call was made with (usage by key).

Downgrading puts each tenant's oldest working key (else its oldest key) back in
tenants; the other keys are lost.

Revision ID: 0019e
Revises: 0018
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0019e"
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("key_prefix", sa.String(length=16), nullable=False),
        sa.Column("scopes", postgresql.ARRAY(sa.String(length=16)), nullable=False),
        sa.Column("requests_per_min", sa.Integer(), nullable=True),
        sa.Column("expires_at", TZ, nullable=True),
        sa.Column("revoked_at", TZ, nullable=True),
        sa.Column("last_used_at", TZ, nullable=True),
        sa.Column("rotated_from", sa.BigInteger(), nullable=True),
        sa.Column("created_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "requests_per_min > 0", name=op.f("ck_api_keys_requests_per_min_positive")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])
    op.execute(
        """
        INSERT INTO api_keys (tenant_id, name, key_hash, key_prefix, scopes, revoked_at,
                              created_at)
        SELECT id, 'default', key_hash, key_prefix,
               ARRAY['batches', 'calls', 'read', 'admin']::varchar(16)[], revoked_at, created_at
        FROM tenants ORDER BY id
        """
    )
    op.drop_constraint(op.f("uq_tenants_key_hash"), "tenants", type_="unique")
    op.drop_column("tenants", "key_hash")
    op.drop_column("tenants", "key_prefix")
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("actor", sa.String(length=300), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=True),
        sa.Column("key_id", sa.BigInteger(), nullable=True),
        sa.Column("before", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("after", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_audit_log_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index(op.f("ix_audit_log_tenant_id"), "audit_log", ["tenant_id"])
    op.add_column("batches", sa.Column("key_id", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("batches", "key_id")
    op.drop_index(op.f("ix_audit_log_tenant_id"), table_name="audit_log")
    op.drop_table("audit_log")
    op.add_column("tenants", sa.Column("key_hash", sa.String(length=64), nullable=True))
    op.add_column("tenants", sa.Column("key_prefix", sa.String(length=16), nullable=True))
    op.execute(
        """
        UPDATE tenants AS t SET key_hash = k.key_hash, key_prefix = k.key_prefix
        FROM (SELECT DISTINCT ON (tenant_id) tenant_id, key_hash, key_prefix
              FROM api_keys
              ORDER BY tenant_id, (revoked_at IS NOT NULL), created_at, id) AS k
        WHERE k.tenant_id = t.id
        """
    )
    # A tenant without a key gets a hash no key has.
    op.execute(
        "UPDATE tenants SET key_hash = md5(random()::text) || md5(random()::text), "
        "key_prefix = 'bg_none' WHERE key_hash IS NULL"
    )
    op.alter_column("tenants", "key_hash", nullable=False)
    op.alter_column("tenants", "key_prefix", nullable=False)
    op.create_unique_constraint(op.f("uq_tenants_key_hash"), "tenants", ["key_hash"])
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.drop_table("api_keys")
