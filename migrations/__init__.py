"""Alembic migrations, installed as `batchmlx.migrations` (see setup.py); Alembic loads the
files here by path, and skips this file when it lists the versions."""
