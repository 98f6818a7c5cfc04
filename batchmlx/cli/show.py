"""How the CLI prints a batch: one summary line, its token and prefix-cache figures, and where
its results are; or the OpenAI Batch object for scripts."""

from __future__ import annotations

import time

import typer

from batchmlx.cli.common import print_json
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.progress import estimate_batch, format_eta, format_rate
from batchmlx.core.records import BatchRecord
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.openai import batch_object


def summary(rec: BatchRecord) -> str:
    c = rec.request_counts
    done = c.completed + c.failed
    return (
        f"{rec.id}  {rec.status.value:<11} {done}/{c.total} done "
        f"({c.completed} ok, {c.failed} failed)  {rec.endpoint}  model={rec.model}"
    )


def stats_lines(rec: BatchRecord) -> list[str]:
    u = rec.usage
    lines = [
        f"tokens: {u.input_tokens} prompt ({u.cached_tokens} from the prefix cache), "
        f"{u.output_tokens} generated"
    ]
    if rec.in_progress_at is not None:
        est = estimate_batch(rec, time.time())
        line = f"throughput: {format_rate(est.tokens_per_s)} generated"
        if rec.status is BatchStatus.IN_PROGRESS:
            line += f"; ETA {format_eta(est.eta_s)} (at the rate measured since it started)"
        lines.append(line)
    s = rec.stats or {}
    if "hits" in s or "prefix_hits" in s or u.input_tokens:
        hits, phits, misses = s.get("hits", 0), s.get("prefix_hits", 0), s.get("misses", 0)
        n = hits + phits + misses
        rate = f"{(hits + phits) / n:.0%}" if n else "n/a"
        lines.append(
            f"prefix cache: hit rate {rate} (HIT {hits}, PREFIX_HIT {phits}, MISS {misses}); "
            f"prefill tokens computed {u.input_tokens - u.cached_tokens}, "
            f"reused {u.cached_tokens}"
        )
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
        typer.echo(f"  download: batchmlx results {rec.id} -o {rec.id}.jsonl  (--errors: errors)")
