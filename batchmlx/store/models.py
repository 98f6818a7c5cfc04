"""The schema as SQLAlchemy declarative models. Alembic migrations create it; nothing else does.

Times are unix seconds: integers on the OpenAI-facing batch and file rows, floats where leases
and heartbeats need sub-second precision. JSON columns are TEXT written with orjson by the store.
"""

from __future__ import annotations

from sqlalchemy import (
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class FileRow(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "file-…"
    filename: Mapped[str] = mapped_column(Text)
    purpose: Mapped[str] = mapped_column(String(32), index=True)  # "batch", "batch_output"
    bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)  # where the content lives: a path, or "db:<id>"
    expires_at: Mapped[int | None] = mapped_column(Integer, index=True)  # deleted after this


class BatchRow(Base):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "batch_…"
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(Text)
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)  # BatchStatus value
    created_at: Mapped[int] = mapped_column(Integer, index=True)
    expires_at: Mapped[int | None] = mapped_column(Integer)
    in_progress_at: Mapped[int | None] = mapped_column(Integer)
    finalizing_at: Mapped[int | None] = mapped_column(Integer)
    completed_at: Mapped[int | None] = mapped_column(Integer)
    failed_at: Mapped[int | None] = mapped_column(Integer)
    expired_at: Mapped[int | None] = mapped_column(Integer)
    cancelling_at: Mapped[int | None] = mapped_column(Integer)
    cancelled_at: Mapped[int | None] = mapped_column(Integer)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    errors: Mapped[str | None] = mapped_column(Text)  # JSON list of BatchErrorRecord fields
    metadata_: Mapped[str | None] = mapped_column("metadata", Text)  # JSON object or null
    content_hash: Mapped[str | None] = mapped_column(String(128), index=True)  # inbox de-dup
    source: Mapped[str | None] = mapped_column(Text)  # "cli", "inbox:/path", …
    stats: Mapped[str | None] = mapped_column(Text)  # JSON object: batchmlx's own figures
    output_expires_after: Mapped[int | None] = mapped_column(Integer)  # seconds, for output files
    # lower is claimed first (core/priority.py); metadata.priority or `submit --priority`
    priority: Mapped[int] = mapped_column(Integer, server_default="0")


class RequestRow(Base):
    __tablename__ = "requests"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id"),
        Index(None, "batch_id", "line"),  # line order for claim and results
        Index(None, "batch_id", "status"),  # live counts per batch
        Index(None, "status", "lease_expires_at"),  # claiming: queued, or running and expired
        Index(None, "worker_id", "status"),  # heartbeat, complete, release
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(String(64), ForeignKey("batches.id", ondelete="CASCADE"))
    line: Mapped[int] = mapped_column(Integer)  # 1-based line of the input file
    custom_id: Mapped[str] = mapped_column(Text)
    body: Mapped[str] = mapped_column(Text)  # JSON request body
    status: Mapped[str] = mapped_column(String(16))  # RequestStatus value
    worker_id: Mapped[str | None] = mapped_column(String(128))  # lease holder while running
    lease_expires_at: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")  # claims so far
    claimed_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer)
    response_body: Mapped[str | None] = mapped_column(Text)  # JSON
    error: Mapped[str | None] = mapped_column(Text)  # JSON line-level error object
    prompt_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    cached_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    completion_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    cache_outcome: Mapped[str | None] = mapped_column(String(16))  # "MISS", "HIT", "PREFIX_HIT"


class WorkerRow(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    pid: Mapped[int | None] = mapped_column(Integer)
    hostname: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float, index=True)


class FileChunkRow(Base):
    """A file's bytes in the database, in order (PostgreSQL: hosts share the database only)."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0, 1, … in file order
    data: Mapped[bytes] = mapped_column(LargeBinary)


FILES = FileRow.__table__
FILE_CHUNKS = FileChunkRow.__table__
BATCHES = BatchRow.__table__
REQUESTS = RequestRow.__table__
WORKERS = WorkerRow.__table__
