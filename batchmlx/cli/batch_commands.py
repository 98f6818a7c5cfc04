"""The commands on batches: submit (and --wait), status, list, results, cancel. Each parses,
calls a batches/ or store function, and prints."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from batchmlx.cli.common import fail, print_json, run_with_store, settings_of, warn_if_slow_blas
from batchmlx.cli.engine_options import EngineChoice, engine_options
from batchmlx.cli.model_options import ModelAliasOpt, StrictModelsOpt, with_model_rule
from batchmlx.cli.show import NO_FILE_EXIT, no_file_text, show, table, worker_hint
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.priority import MAX_BATCH_PRIORITY, MIN_BATCH_PRIORITY
from batchmlx.core.records import BatchRecord
from batchmlx.formats.batch_request import PRIORITY_KEY
from batchmlx.formats.openai import batch_object

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the OpenAI Batch object(s)")]
LimitOpt = Annotated[int, typer.Option(min=1, help="Batches to list at most")]


@engine_options
def submit(
    ctx: typer.Context,
    file: Annotated[
        Path | None, typer.Argument(help="OpenAI Batch input file (JSONL)", show_default=False)
    ] = None,
    example: Annotated[
        bool,
        typer.Option(
            "--example",
            help="Submit the example batch shipped with batchmlx "
            "(8 chat requests; `batchmlx example` prints it)",
        ),
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            help="Serve the file with this model, whatever its bodies name: "
            "'default', a local MLX folder, a .gguf file or a hub id (without it, "
            "a name that is no model here is served by 'default'; docs/models.md)"
        ),
    ] = None,
    strict_models: StrictModelsOpt = None,
    model_alias: ModelAliasOpt = None,
    wait: Annotated[bool, typer.Option(help="Run to completion, showing progress")] = False,
    endpoint: Annotated[
        str | None,
        typer.Option(
            help="The batch's endpoint, e.g. /v1/chat/completions; a line with "
            "another url fails the file. Default: the first line's url"
        ),
    ] = None,
    completion_window: Annotated[str, typer.Option(help="e.g. 24h (OpenAI's), 90m, 2d")] = "24h",
    metadata: Annotated[list[str] | None, typer.Option(help="key=value, repeatable")] = None,
    priority: Annotated[
        int | None,
        typer.Option(
            min=MIN_BATCH_PRIORITY,
            max=MAX_BATCH_PRIORITY,
            help="Lower runs first, as vLLM's priorities (default 0; online requests come "
            "before every batch; a waiting batch gains a level per --priority-aging-s); "
            "stored as metadata priority",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the Batch object")] = False,
    output_expires_after: Annotated[
        int | None,
        typer.Option(
            help="Seconds (3600-2592000) after which the output and error files are "
            "deleted; default: kept"
        ),
    ] = None,
    *,
    engine: EngineChoice,
) -> None:
    """Validate a batch file and enqueue it (and run it with --wait, under the engine
    options)."""
    settings = with_model_rule(settings_of(ctx), strict_models, model_alias)
    if (file is None) != example:  # usage errors, as click's own (exit 2, see --help)
        raise typer.BadParameter(
            "give a batch file or --example, not both" if example
            else "missing (give a batch file, or --example for the example batch)",
            ctx=ctx, param_hint="'FILE'",
        )  # fmt: skip
    if file is None:
        from batchmlx.cli.examples import example_path

        file = example_path()
    if not file.is_file():
        raise fail(f"no such file: {file}")
    from batchmlx.formats.expiry import ExpiresAfterError, parse_expires_after

    if output_expires_after is not None:
        try:
            parse_expires_after({"anchor": "created_at", "seconds": output_expires_after},
                                "output_expires_after")  # fmt: skip
        except ExpiresAfterError as exc:
            raise fail(str(exc)) from None
    bad = [m for m in metadata or [] if "=" not in m]
    if bad:
        raise fail(f"--metadata expects key=value, got {bad[0]!r}")
    meta = dict(m.split("=", 1) for m in metadata or []) or None
    if priority is not None:
        given = (meta or {}).get(PRIORITY_KEY)
        if given is not None and given != str(priority):
            raise fail(f"--priority {priority} and --metadata {PRIORITY_KEY}={given} disagree")
        meta = {**(meta or {}), PRIORITY_KEY: str(priority)}
    from batchmlx.batches.files import read_chunks
    from batchmlx.batches.intake import submit as submit_batch
    from batchmlx.worker.housekeeping import running_workers

    async def enqueue(store) -> tuple[BatchRecord, int]:
        rec = await submit_batch(
            store, settings, read_chunks(file), filename=file.name, now=time.time(),
            model=model, completion_window=completion_window, metadata=meta,
            output_expires_after=output_expires_after, endpoint=endpoint,
        )  # fmt: skip
        live = [] if wait else await running_workers(store, settings)
        return rec, len(live)

    rec, workers = run_with_store(settings, enqueue)
    if rec.status is BatchStatus.FAILED:
        show(rec, settings, as_json)
        raise typer.Exit(1)
    if wait:
        warn_if_slow_blas(engine.dtype, settings.cpu)
        rec = _wait(settings, rec.id, engine, as_json)
    show(rec, settings, as_json)
    if not wait and not as_json and not rec.status.terminal:
        typer.echo("  " + worker_hint(workers))
    if wait and rec.status is not BatchStatus.COMPLETED:
        raise typer.Exit(1)


def _wait(settings: Settings, batch_id: str, engine: EngineChoice, quiet: bool) -> BatchRecord:
    """Follow a batch to its end; while no worker runs (none, or the one followed died), run
    one in this process."""
    from batchmlx.cli.progress import REFRESH_S, ProgressView
    from batchmlx.ingest import INBOX_HOOKS
    from batchmlx.store import Store
    from batchmlx.worker import WorkerOptions, run_worker
    from batchmlx.worker.housekeeping import running_workers

    async def main() -> BatchRecord:
        store = await Store.from_settings(settings)
        try:
            progress = ProgressView(store, batch_id, quiet)
            while not (await store.get_batch(batch_id)).status.terminal:
                if await running_workers(store, settings):
                    await progress.show()
                    await asyncio.sleep(REFRESH_S)
                    continue
                opts = WorkerOptions(until_idle=True, dtype=engine.dtype, engine=engine.settings)
                task = asyncio.create_task(progress.run())
                try:
                    await run_worker(settings, opts, store=store, finalize_hooks=INBOX_HOOKS)
                finally:
                    task.cancel()
                if not (await store.get_batch(batch_id)).status.terminal:
                    # idle while requests of the batch are leased elsewhere (a worker on
                    # another host): follow them
                    await asyncio.sleep(REFRESH_S)
            await progress.show(final=True)
            return await store.get_batch(batch_id)
        finally:
            await store.close()

    return asyncio.run(main())


def status(
    ctx: typer.Context,
    batch_id: Annotated[str | None, typer.Argument(help="One batch; all when omitted")] = None,
    as_json: JsonOpt = False,
    limit: LimitOpt = 20,
) -> None:
    """Show batches: a table, or one batch in detail."""
    if batch_id is None:
        list_(ctx, as_json=as_json, limit=limit)
        return
    from batchmlx.batches.finalize import get_batch
    from batchmlx.batches.lifecycle import expire_unattended
    from batchmlx.ingest import INBOX_HOOKS

    settings = settings_of(ctx)

    async def current(store) -> BatchRecord:
        rec = await get_batch(store, batch_id)
        return await expire_unattended(store, settings, rec, now=store.clock(), hooks=INBOX_HOOKS)

    show(run_with_store(settings, current), settings, as_json)


def list_(ctx: typer.Context, as_json: JsonOpt = False, limit: LimitOpt = 20) -> None:
    """List batches, newest first."""
    recs = run_with_store(settings_of(ctx), lambda store: store.list_batches(limit=limit))
    if as_json:
        print_json([batch_object(r) for r in recs])
        return
    if not recs:
        typer.echo("no batches")
        return
    for line in table(recs):
        typer.echo(line)


def results(
    ctx: typer.Context,
    batch_id: str,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write here, not stdout")
    ] = None,
    errors: Annotated[bool, typer.Option("--errors", help="The error file instead")] = False,
) -> None:
    """Download a finished batch's output file (or, with --errors, its error file). A batch
    without that file (no request succeeded; --errors: none failed) exits 3 and says which
    file it has."""

    async def fetch(store) -> tuple[BatchRecord, int | None]:
        from batchmlx.batches.errors import BatchError
        from batchmlx.batches.files import iter_file_content
        from batchmlx.batches.finalize import get_batch
        from batchmlx.store.blobs import LocalBlobs

        rec = await get_batch(store, batch_id)
        if not rec.status.terminal:
            raise BatchError(f"batch {batch_id} is {rec.status.value}; not finished yet")
        file_id = rec.error_file_id if errors else rec.output_file_id
        if file_id is None:
            return rec, None  # said below; nothing written, not even an empty -o file
        chunks = iter_file_content(store, file_id)
        if output is not None:  # streamed to a temp file, fsynced, renamed
            return rec, (await LocalBlobs(output.parent).put(output.name, chunks))[0]
        size = 0
        async for chunk in chunks:
            sys.stdout.buffer.write(chunk)
            size += len(chunk)
        sys.stdout.buffer.flush()
        return rec, size

    rec, size = run_with_store(settings_of(ctx), fetch)
    if size is None:
        typer.echo(no_file_text(rec, errors), err=True)
        raise typer.Exit(NO_FILE_EXIT)
    if output is not None:
        typer.echo(f"wrote {size} bytes to {output}", err=True)


def cancel(
    ctx: typer.Context, batch_id: str, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """Cancel a batch: running requests stop, finished results are kept."""
    from batchmlx.batches.lifecycle import cancel_unattended
    from batchmlx.ingest import INBOX_HOOKS

    settings = settings_of(ctx)
    rec = run_with_store(settings, lambda store: cancel_unattended(
        store, settings, batch_id, now=store.clock(), hooks=INBOX_HOOKS))  # fmt: skip
    show(rec, settings, as_json)
