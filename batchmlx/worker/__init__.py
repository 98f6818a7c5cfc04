"""The worker: the composition root that wires store, formats and engine."""

from batchmlx.worker.loop import Worker, WorkerOptions, run_worker

__all__ = ["Worker", "WorkerOptions", "run_worker"]
