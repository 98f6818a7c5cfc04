"""Expiring files: files.expires_at; batches.output_expires_after (seconds).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMN: nullable columns need no table rebuild on SQLite
    op.add_column("files", sa.Column("expires_at", sa.Integer(), nullable=True))
    op.create_index(op.f("ix_files_expires_at"), "files", ["expires_at"])
    op.add_column("batches", sa.Column("output_expires_after", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("output_expires_after")
    op.drop_index(op.f("ix_files_expires_at"), table_name="files")
    with op.batch_alter_table("files") as batch:
        batch.drop_column("expires_at")
