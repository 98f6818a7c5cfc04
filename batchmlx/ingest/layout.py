"""The inbox folder layout, in one place (results.py writes result copies, the watcher moves files).

    DIR/NAME.jsonl                          dropped by the user; ingested once complete
    DIR/done/NAME.jsonl                     ingested (a batch was made, or it duplicated one)
    DIR/failed/NAME.jsonl                   refused: failed validation, or could not be taken
    DIR/failed/NAME.errors.json             ... and why (a second NAME.jsonl: NAME.1.*)
    DIR/results/NAME.BATCH_ID.output.jsonl  the batch's output file, written when the batch ends
    DIR/results/NAME.BATCH_ID.errors.jsonl  its error file, when it has one

A batch's `source` names the drop: the file's path and what tells this drop of it from a later
one of the same name (inode, mtime, size), so a restart after a crash between the batch's
commit and the file's move recognises the file instead of submitting it again.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

SOURCE_PREFIX = "inbox:"
DONE, FAILED, RESULTS = "done", "failed", "results"
_DROP_SUFFIX = re.compile(r"#drop=\d+-\d+-\d+$")  # a real inbox file name ends in .jsonl


@dataclass(frozen=True, slots=True)
class Drop:
    """One file as it was dropped: the same path written again is another drop."""

    path: Path  # absolute, in the inbox folder
    inode: int
    mtime_ns: int
    size: int

    @classmethod
    def of(cls, path: Path, st: os.stat_result) -> Drop:
        return cls(path, st.st_ino, st.st_mtime_ns, st.st_size)

    @property
    def source(self) -> str:
        """The batch's `source` column for a file ingested from an inbox."""
        return f"{SOURCE_PREFIX}{self.path}#drop={self.inode}-{self.mtime_ns}-{self.size}"


def source_path(source: str | None) -> Path | None:
    """The dropped file's path of an inbox batch (older sources have no drop suffix)."""
    if not source or not source.startswith(SOURCE_PREFIX):
        return None
    return Path(_DROP_SUFFIX.sub("", source[len(SOURCE_PREFIX) :]))


def result_paths(source: str | None, batch_id: str) -> tuple[Path, Path] | None:
    """(output, errors) paths for a batch from an inbox; None for other batches. The batch id
    in the name keeps two drops of the same name from sharing (or deleting) results."""
    src = source_path(source)
    if src is None:
        return None
    results = src.parent / RESULTS
    stem = f"{src.stem}.{batch_id}"
    return results / f"{stem}.output.jsonl", results / f"{stem}.errors.jsonl"
