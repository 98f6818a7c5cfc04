"""The only package with SQL: the schema, its migrations, and the named operations of `Store`."""

from __future__ import annotations

from batchmlx.store.store import Store
from batchmlx.store.types import BatchRef, NewRequest, ResultRow, StoreUnavailable

__all__ = ["BatchRef", "NewRequest", "ResultRow", "Store", "StoreUnavailable"]
