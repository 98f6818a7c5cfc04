"""The one error a batch operation raises for something the user asked that cannot be done."""

from __future__ import annotations


class BatchError(Exception):
    """A request the user made that cannot be done (unknown id, finished batch, …)."""
