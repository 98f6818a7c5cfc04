"""Alembic environment for batchmlx: SQLite (sync, BEGIN IMMEDIATE) or PostgreSQL (asyncpg,
an advisory lock), one transaction per run. The URL is parsed once (batchmlx.database_url) and
the target says which."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import Connection, create_engine, pool, text
from sqlalchemy.ext.asyncio import create_async_engine

from batchmlx.database_url import Target, parse_target
from batchmlx.store.connection import install_sqlite_setup
from batchmlx.store.migrate import MIGRATE_LOCK_KEY
from batchmlx.store.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _migrate(connection: Connection, target: Target) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        transactional_ddl=True,
    )
    with context.begin_transaction():
        if target.is_postgresql:
            # hosts share no disk: serialise first-use upgrades in the database itself; the
            # version is read after the lock, so the second process finds the first's work
            connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATE_LOCK_KEY})
        context.run_migrations()


async def _migrate_async(target: Target) -> None:
    engine = create_async_engine(target.migration_url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_migrate, target)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url is not None
    target = parse_target(url)
    if target.is_postgresql:
        asyncio.run(_migrate_async(target))  # upgrade_to_head runs in a thread of its own
        return
    engine = create_engine(url, poolclass=pool.NullPool)
    install_sqlite_setup(engine)  # WAL from the start; the whole upgrade under BEGIN IMMEDIATE
    try:
        with engine.connect() as connection:
            _migrate(connection, target)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
