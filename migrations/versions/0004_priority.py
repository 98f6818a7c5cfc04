"""Batch priorities: batches.priority (lower is claimed first; core/priority.py).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMN with a server default: existing batches read 0, no table rebuild on SQLite
    op.add_column(
        "batches", sa.Column("priority", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("priority")
