"""Batch and request states, and the one table of moves between them (OpenAI's Batch lifecycle)."""

from __future__ import annotations

import enum


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"  # validation failed; nothing was enqueued
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"  # every request has a result; files are being written
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_BATCH


class RequestStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"  # claimed by a worker holding a lease
    SUCCEEDED = "succeeded"  # goes to the output file
    FAILED = "failed"  # goes to the error file (a 4xx/5xx body or an error object)

    @property
    def done(self) -> bool:
        return self in (RequestStatus.SUCCEEDED, RequestStatus.FAILED)


TERMINAL_BATCH = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)

BATCH_TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset({BatchStatus.IN_PROGRESS, BatchStatus.FAILED}),
    BatchStatus.IN_PROGRESS: frozenset(
        {BatchStatus.FINALIZING, BatchStatus.CANCELLING, BatchStatus.EXPIRED}
    ),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED, BatchStatus.EXPIRED}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED}),
    BatchStatus.FAILED: frozenset(),
    BatchStatus.COMPLETED: frozenset(),
    BatchStatus.EXPIRED: frozenset(),
    BatchStatus.CANCELLED: frozenset(),
}


class TransitionError(ValueError):
    pass


def check_transition(current: BatchStatus, new: BatchStatus) -> None:
    if new not in BATCH_TRANSITIONS[current]:
        raise TransitionError(f"a batch cannot move from {current.value} to {new.value}")


# Batches the completion window still applies to: once finalizing, every request has a result.
EXPIRABLE = frozenset({BatchStatus.IN_PROGRESS})


def is_expired(status: BatchStatus, expires_at: float | None, now: float) -> bool:
    """A batch still running when its completion window ends (`now >= expires_at`) expires:
    its finished results are kept and the rest get `batch_expired` lines."""
    return status in EXPIRABLE and expires_at is not None and now >= expires_at
