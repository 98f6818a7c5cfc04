"""The inbox: a watched folder of batch files, and the copies of their results.

Importing the package registers the finalize hook that writes those copies, so every process
that may finalize (the worker, the CLI, the server) imports it."""

from batchmlx.ingest import results as results  # registers write_inbox_results
