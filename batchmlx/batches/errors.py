"""The one error a batch operation raises for something the user asked that cannot be done."""

from __future__ import annotations


class BatchError(Exception):
    """A request the user made that cannot be done (unknown id, finished batch, …)."""


class CannotCancel(BatchError):
    """Cancel asked of a batch that has ended (or is finalizing); OpenAI's 409 message."""

    def __init__(self, status: str) -> None:
        super().__init__(f"Cannot cancel a batch with status '{status}'.")
        self.status = status
