"""The inbox: a watched folder of batch files, and the copies of their results.

`INBOX_HOOKS` are the finalize hooks that write those copies: every process that may finalize
(the worker, the CLI, the server) passes them to the code that finalizes."""

from batchmlx.ingest.results import INBOX_HOOKS

__all__ = ["INBOX_HOOKS"]
