"""Several hosts on one database: file bytes in the database, insertion order on PostgreSQL.

`file_chunks` holds files when hosts share no disk. SQLite orders rows of equal `created_at` by
its implicit rowid; PostgreSQL has none, so there batches and files get an identity column
`seq` playing that part (not in the declarative models: the store names it per dialect).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SEQ_TABLES = ("batches", "files")


def upgrade() -> None:
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("file_id", "seq", name=op.f("pk_file_chunks")),
    )
    if op.get_bind().dialect.name == "postgresql":
        for table in SEQ_TABLES:
            op.execute(f"ALTER TABLE {table} ADD COLUMN seq BIGINT GENERATED ALWAYS AS IDENTITY")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in SEQ_TABLES:
            op.drop_column(table, "seq")
    op.drop_table("file_chunks")
