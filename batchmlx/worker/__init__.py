"""The worker: the composition root that wires store, formats and engine."""

from batchmlx.worker.loop import Worker, run_worker
from batchmlx.worker.options import WorkerOptions

__all__ = ["Worker", "WorkerOptions", "run_worker"]
