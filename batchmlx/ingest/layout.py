"""The inbox folder layout, in one place (the service writes results, the watcher moves files).

    DIR/NAME.jsonl                  dropped by the user; ingested once complete
    DIR/done/NAME.jsonl             ingested (a batch was made, or it duplicated one)
    DIR/failed/NAME.jsonl           failed validation; DIR/failed/NAME.errors.json says why
    DIR/results/NAME.output.jsonl   the batch's output file, written when the batch ends
    DIR/results/NAME.errors.jsonl   its error file, when it has one
"""

from __future__ import annotations

from pathlib import Path

SOURCE_PREFIX = "inbox:"
DONE, FAILED, RESULTS = "done", "failed", "results"


def inbox_source(path: Path) -> str:
    """The batch's `source` column for a file ingested from an inbox."""
    return f"{SOURCE_PREFIX}{path.resolve()}"


def result_paths(source: str | None) -> tuple[Path, Path] | None:
    """(output, errors) paths for a batch from an inbox; None for other batches."""
    if not source or not source.startswith(SOURCE_PREFIX):
        return None
    src = Path(source[len(SOURCE_PREFIX) :])
    results = src.parent / RESULTS
    return results / f"{src.stem}.output.jsonl", results / f"{src.stem}.errors.jsonl"
