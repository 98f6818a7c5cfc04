"""The inbox's copies of a finished batch's files, written by a finalize hook that the
composition roots pass to whoever finalizes (`INBOX_HOOKS`)."""

from __future__ import annotations

import logging

from batchmlx.batches.files import copy_file
from batchmlx.batches.finalize import Finalized, FinalizeHook
from batchmlx.ingest.layout import result_paths
from batchmlx.store import Store

log = logging.getLogger("batchmlx.inbox")


async def write_inbox_results(store: Store, done: Finalized) -> None:
    """A batch from an inbox also gets DIR/results/NAME.BATCH_ID.output.jsonl (and
    .errors.jsonl); the names are the batch's own, so no other batch's file is touched.

    The copies are a convenience: the batch's files are already in files/, so a copy that
    cannot be written (results/ unwritable or not a folder, disk full) is logged and noted in
    the batch's stats (`inbox_results_error`), and the batch completes all the same."""
    paths = result_paths(await store.batch_source(done.batch_id), done.batch_id)
    if paths is None:
        return
    try:  # streamed from the store: a 200 MB output file is never whole in memory
        await copy_file(store, done.output_file_id, paths[0])
        if done.error_file_id is not None:
            await copy_file(store, done.error_file_id, paths[1])
    except OSError as exc:
        log.error("batch %s: inbox result copy not written (%s); the batch's files are in "
                  "files/ (batchmlx results %s)", done.batch_id, exc, done.batch_id)  # fmt: skip
        await store.update_batch_stats(done.batch_id, {"inbox_results_error": str(exc)})


# what every process that may finalize a batch (worker, CLI, server) passes to finalize
INBOX_HOOKS: tuple[FinalizeHook, ...] = (write_inbox_results,)
