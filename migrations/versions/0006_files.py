"""files; batches.input_file_id

- files holds what a tenant uploads through ``POST /v1/files`` (the OpenAI Files
  API): the content itself (bytea, bounded by ``max_body_bytes``), so that every
  API host sees it, and when it expires (``file_retention_s``, or the upload's
  own ``expires_after``); the sweep deletes expired files.
- batches.input_file_id names the file a batch was created from (``POST
  /v1/batches`` with ``input_file_id``); it stays when the file is deleted, as
  OpenAI's does.
- A trigger tells the API a synchronous call ended: when an item of priority rank
  -1 (a call, batchgen.domain.lifecycle.status.CALL_RANK) reaches a terminal status, its id
  is sent on the channel ``batchgen_call_done`` (NOTIFY, delivered at commit, when
  the result is visible). Every other item's update only evaluates the WHEN.

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("purpose", sa.String(length=40), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_files_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index(
        "ix_files_tenant_id_created_at", "files", ["tenant_id", "created_at"], unique=False
    )
    op.create_index("ix_files_expires_at", "files", ["expires_at"], unique=False)
    op.add_column("batches", sa.Column("input_file_id", sa.String(length=40), nullable=True))
    op.execute(
        """
        CREATE FUNCTION batchgen_call_done() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('batchgen_call_done', NEW.id::text);
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        """
        CREATE TRIGGER items_call_done AFTER UPDATE OF status ON items
        FOR EACH ROW
        WHEN (NEW.priority_rank < 0
              AND NEW.status IN ('succeeded', 'failed', 'expired', 'cancelled')
              AND OLD.status IS DISTINCT FROM NEW.status)
        EXECUTE FUNCTION batchgen_call_done()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER items_call_done ON items")
    op.execute("DROP FUNCTION batchgen_call_done()")
    op.drop_column("batches", "input_file_id")
    op.drop_index("ix_files_expires_at", table_name="files")
    op.drop_index("ix_files_tenant_id_created_at", table_name="files")
    op.drop_table("files")
