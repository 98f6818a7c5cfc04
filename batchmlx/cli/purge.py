"""`batchmlx purge`: remove the batches that finished (completed, failed, expired, cancelled)
more than N days ago, their request rows, batch rows and files, and say what went."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from batchmlx.cli.common import fail, print_json, run_with_store, settings_of
from batchmlx.config import RETENTION_DAYS_ENV


def _when(t: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def purge(
    ctx: typer.Context,
    older_than: Annotated[
        float | None,
        typer.Option(
            min=0,
            metavar="DAYS",
            help="Batches that finished more than DAYS ago "
            f"(default: ${RETENTION_DAYS_ENV}; 0: every finished batch)",
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Say what would go; remove nothing")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print what went as JSON")] = False,
) -> None:
    """Remove finished batches older than DAYS: their requests (prompts, responses), batch
    rows, and input, output and error files."""
    settings = settings_of(ctx)
    days = older_than if older_than is not None else settings.retention_days
    if days is None:
        raise fail(f"say how old: --older-than DAYS (or set ${RETENTION_DAYS_ENV})")
    from batchmlx.batches.retention import finished_before, purge_finished

    async def go(store: Any) -> list[Any]:
        now = store.clock()
        if dry_run:
            return await finished_before(store, older_than_days=days, now=now)
        return await purge_finished(store, older_than_days=days, now=now)

    gone = run_with_store(settings, go)
    if as_json:
        print_json([_as_json(g) for g in gone])
        return
    verb = "would purge" if dry_run else "purged"
    for g in gone:
        line = f"{verb} {g.id}  {g.status.value:<9}  finished {_when(g.finished_at)}"
        if not dry_run:
            files = ", ".join(f.id for f in g.files) or "none"
            line += f"  {g.requests} requests; files: {files}"
        typer.echo(line)
    batches = f"{len(gone)} batch{'es' if len(gone) != 1 else ''}"
    total = f"{verb} {batches} finished over {days:g} days ago"
    if not dry_run:
        total += (f" ({sum(g.requests for g in gone)} requests, "
                  f"{sum(len(g.files) for g in gone)} files)")  # fmt: skip
    typer.echo(total)


def _as_json(g: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": g.id, "status": g.status.value, "finished_at": g.finished_at}
    if hasattr(g, "files"):
        obj |= {"requests": g.requests, "files": [f.id for f in g.files]}
    return obj
