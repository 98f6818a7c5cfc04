"""A batch's life, shared by the CLI, the inbox, the HTTP API and the worker.

intake (create `validating`, then validate: one path for every caller), files (bytes through
the store's blob seam, under files/ or in the database, and their records), finalize (writes the
output and error files once per batch, under the store's batch lock; the lines come from
formats/output), lifecycle (cancel, expiry, settling with no worker), windows (completion
windows). Each function takes an open Store and Settings, and `now` where time matters, so
tests drive them without clocks or processes. No MLX here.
"""

from batchmlx.batches import files, finalize, intake, lifecycle, windows
from batchmlx.batches.errors import BatchError

__all__ = ["BatchError", "files", "finalize", "intake", "lifecycle", "windows"]
