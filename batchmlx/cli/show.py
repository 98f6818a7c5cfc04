"""How the CLI prints a batch: one summary line, its token and prefix-cache figures, and where
its results are; or the OpenAI Batch object for scripts."""

from __future__ import annotations

import time

import typer

from batchmlx.cli.common import print_json
from batchmlx.config import Settings
from batchmlx.core.batch_text import cache_text, counts_text, model_text, tokens_text
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.progress import estimate_batch, format_eta, format_rate
from batchmlx.core.records import BatchRecord
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.openai import batch_object


def summary(rec: BatchRecord) -> str:
    return (
        f"{rec.id}  {rec.status.value:<11} {counts_text(rec)}  {rec.endpoint}  "
        f"model={model_text(rec)}"
    )


_COLUMNS = ("ID", "STATUS", "DONE", "OK", "FAILED", "ENDPOINT", "MODEL", "CREATED")
_RIGHT = frozenset({"DONE", "OK", "FAILED"})  # numbers: right-aligned


def table(recs: list[BatchRecord]) -> list[str]:
    """`status`/`list`: a header, then one row per batch, in aligned columns."""
    rows = [_COLUMNS] + [_row(r) for r in recs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return [
        "  ".join(
            cell.rjust(w) if name in _RIGHT else cell.ljust(w)
            for name, cell, w in zip(_COLUMNS, row, widths, strict=True)
        ).rstrip()
        for row in rows
    ]


def _row(rec: BatchRecord) -> tuple[str, ...]:
    c = rec.request_counts
    created = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.created_at))
    return (rec.id, rec.status.value, f"{c.completed + c.failed}/{c.total}", str(c.completed),
            str(c.failed), rec.endpoint or "-", model_text(rec), created)  # fmt: skip


# a batch in progress that no worker has taken up yet
WAITING = "waiting for a worker: none has taken this batch up yet"


def stats_lines(rec: BatchRecord) -> list[str]:
    u = rec.usage
    lines = [f"tokens: {tokens_text(rec)}"]
    if rec.status is BatchStatus.IN_PROGRESS and rec.work_started_at is None:
        lines.append(WAITING)
    elif rec.work_started_at is not None:
        est = estimate_batch(rec, time.time())
        line = f"throughput: {format_rate(est.tokens_per_s)} generated"
        if rec.status is BatchStatus.IN_PROGRESS:
            line += f"; ETA {format_eta(est.eta_s)} (at the rate since a worker took it up)"
        lines.append(line)
    if rec.outcomes.total or u.input_tokens:
        lines.append(f"prefix cache: {cache_text(rec)}")
    return lines


def show(rec: BatchRecord, settings: Settings, as_json: bool) -> None:
    """The OpenAI Batch object for scripts, or a description for people."""
    if as_json:
        print_json(batch_object(rec))
    else:
        describe(rec, settings)


def describe(rec: BatchRecord, settings: Settings) -> None:
    typer.echo(summary(rec))
    for line in stats_lines(rec):
        typer.echo("  " + line)
    if rec.errors:
        cut = rec.errors[-1].code == ErrorCode.TOO_MANY_ERRORS  # its message gives the total
        typer.echo(
            f"  validation failed; the first {len(rec.errors) - 1} errors:"
            if cut
            else f"  validation failed with {len(rec.errors)} error(s):"
        )
        for e in rec.errors:
            where = f"line {e.line}" if e.line else "file"
            param = f" [{e.param}]" if e.param else ""
            typer.echo(f"    {where}: {e.code}{param}: {e.message}")
    for label, fid in (("output", rec.output_file_id), ("errors", rec.error_file_id)):
        if fid:
            where = "in the database" if settings.files_in_database else settings.files_dir / fid
            typer.echo(f"  {label}: {where}  ({fid})")
    if rec.status.terminal and not rec.errors:
        typer.echo("  " + download_hint(rec))


def download_hint(rec: BatchRecord) -> str:
    """How to fetch the files a finished batch has (and only those)."""
    commands = [f"batchmlx results {rec.id}{flag} -o {rec.id}{suffix}.jsonl"
                for fid, flag, suffix in ((rec.output_file_id, "", ""),
                                          (rec.error_file_id, " --errors", "_errors"))
                if fid]  # fmt: skip
    if not commands:
        return "no output or error file: the batch has no requests"
    return "download: " + "; ".join(commands)


def worker_hint(live_workers: int) -> str:
    """After `submit` without --wait: who will run the batch."""
    if live_workers:
        return (f"a worker is running ({live_workers} live); it takes this batch up in turn: "
                "follow it with `batchmlx status ID`")  # fmt: skip
    return (
        "no worker is running: start one with `batchmlx worker` (or `batchmlx serve`) to "
        "run this batch, or submit with --wait to run it here"
    )


# `results` of a batch without the file asked for: not an error (the batch is fine), not a
# success (nothing was written): its own status, for scripts
NO_FILE_EXIT = 3


def no_file_text(rec: BatchRecord, errors: bool) -> str:
    """What a finished batch has when it lacks the file `results` was asked for."""
    c, which = rec.request_counts, "error" if errors else "output"
    if not c.total:
        return f"{rec.id} has no {which} file: it has no requests"
    if errors:
        return (f"{rec.id} ({rec.status.value}) has no error file: all {c.completed} "
                f"of its requests succeeded; the output: batchmlx results {rec.id}")  # fmt: skip
    other = (f"; their errors: batchmlx results {rec.id} --errors"
             if rec.error_file_id else "")  # fmt: skip
    return (f"{rec.id} ({rec.status.value}) has no output file: none of its {c.total} "
            f"requests succeeded ({c.failed} failed){other}")  # fmt: skip
