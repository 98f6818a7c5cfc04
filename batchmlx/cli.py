"""The command line: parse, call batches/ or the worker, print. Imports no MLX at import time,
nor the store (SQLAlchemy, Alembic: about 0.4 s): the console script decides first whether to
re-execute onto the fast BLAS (`main`), and each command imports what it runs."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from batchmlx.config import Settings, load_settings
from batchmlx.core.engine_api import ENGINE_DEFAULTS, EngineSettings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.progress import estimate_batch, format_eta, format_rate
from batchmlx.core.records import BatchRecord
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.openai import batch_object

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Local, OpenAI-Batch-compatible job processor for LLM requests on MLX.",
)

DATABASE_URL_ENV = "BATCHMLX_DATABASE_URL"


@app.callback()
def _options(
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            envvar=DATABASE_URL_ENV,
            help="The queue: sqlite:///FILE (default: $BATCHMLX_HOME/batchmlx.db) or "
            "postgresql://USER@HOST/DB, shared by workers on several hosts",
        ),
    ] = None,
) -> None:
    """Local, OpenAI-Batch-compatible job processor for LLM requests on MLX."""
    if database_url:
        os.environ[DATABASE_URL_ENV] = database_url  # load_settings reads it, as do children


def _hoist_database_url(argv: list[str]) -> list[str]:
    """`--database-url` may come after the command too (`batchmlx worker --database-url …`):
    move it before the command, where the app's callback takes it."""
    rest, front, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--database-url" and i + 1 < len(argv):
            front += argv[i : i + 2]
            i += 2
            continue
        (front if arg.startswith("--database-url=") else rest).append(arg)
        i += 1
    return front + rest


DTYPE_HELP = "Weights: auto (float32 on the CPU, as stored on Metal/CUDA), stored, float32, …"
# engine options shared by `worker` and `serve`
SimpleOpt = Annotated[bool, typer.Option(help="Simple mode: one request at a time")]
MaxBatchOpt = Annotated[
    int, typer.Option(help="Hard cap on the running batch (the adaptive width grows up to it)")
]
AdaptiveWidthOpt = Annotated[
    bool, typer.Option(help="Size the running batch of queued work by measured throughput and "
                       "KV memory (--no-adaptive-width: always --max-batch-size)"),
]
BlockSizeOpt = Annotated[int, typer.Option(help="Tokens per KV block")]
PagedCacheOpt = Annotated[
    bool, typer.Option(help="Share prefix blocks between requests (on by default)")
]
CacheMemoryMbOpt = Annotated[int | None, typer.Option(help="Explicit KV memory bound")]
DtypeOpt = Annotated[str, typer.Option(help=DTYPE_HELP)]


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def _warn_if_slow_blas() -> None:
    """One loud line on stderr when MLX would run on the reference BLAS (see batchmlx.accel)."""
    from batchmlx.accel import slow_blas_warning

    line = slow_blas_warning()
    if line:
        typer.secho(line, fg=typer.colors.YELLOW, bold=True, err=True)


def _run(coro_fn, *args: Any, **kwargs: Any) -> Any:
    """Open the store, run one coroutine, close the store."""
    from batchmlx.batches.errors import BatchError
    from batchmlx.store import Store, StoreUnavailable

    settings = load_settings()

    async def main() -> Any:
        store = await Store.from_settings(settings)
        try:
            return await coro_fn(store, settings, *args, **kwargs)
        finally:
            await store.close()

    try:
        return asyncio.run(main())
    except (BatchError, StoreUnavailable) as exc:
        raise _fail(str(exc)) from None


def _print_json(obj: Any) -> None:
    sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")


def _summary(rec: BatchRecord) -> str:
    c = rec.request_counts
    done = c.completed + c.failed
    return (
        f"{rec.id}  {rec.status.value:<11} {done}/{c.total} done "
        f"({c.completed} ok, {c.failed} failed)  {rec.endpoint}  model={rec.model}"
    )


def _stats_lines(rec: BatchRecord) -> list[str]:
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


def _show(rec: BatchRecord, as_json: bool) -> None:
    """The OpenAI Batch object for scripts, or a description for people."""
    if as_json:
        _print_json(batch_object(rec))
    else:
        _describe(rec, load_settings())


def _describe(rec: BatchRecord, settings: Settings) -> None:
    typer.echo(_summary(rec))
    for line in _stats_lines(rec):
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


# -- submit ----------------------------------------------------------------------------------


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="OpenAI Batch input file (JSONL)")],
    model: Annotated[
        str | None,
        typer.Option(help="Serve the file with this model, whatever its bodies name: "
                     "'default', a local MLX folder, a .gguf file or a hub id"),
    ] = None,
    wait: Annotated[bool, typer.Option(help="Run to completion, showing progress")] = False,
    completion_window: Annotated[str, typer.Option(help="e.g. 24h (OpenAI's), 90m, 2d")] = "24h",
    metadata: Annotated[list[str] | None, typer.Option(help="key=value, repeatable")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the Batch object")] = False,
    simple: Annotated[bool, typer.Option(help="With --wait: simple mode")] = False,
    max_batch_size: Annotated[
        int, typer.Option(help="With --wait: running batch bound")
    ] = ENGINE_DEFAULTS.max_batch_size,
    output_expires_after: Annotated[
        int | None,
        typer.Option(help="Seconds (3600-2592000) after which the output and error files are "
                     "deleted; default: kept"),
    ] = None,
) -> None:
    """Validate a batch file and enqueue it (and run it with --wait)."""
    if not file.is_file():
        raise _fail(f"no such file: {file}")
    from batchmlx.formats.expiry import ExpiresAfterError, parse_expires_after

    if output_expires_after is not None:
        try:
            parse_expires_after({"anchor": "created_at", "seconds": output_expires_after},
                                "output_expires_after")  # fmt: skip
        except ExpiresAfterError as exc:
            raise _fail(str(exc)) from None
    bad = [m for m in metadata or [] if "=" not in m]
    if bad:
        raise _fail(f"--metadata expects key=value, got {bad[0]!r}")
    meta = dict(m.split("=", 1) for m in metadata or []) or None
    from batchmlx.batches.files import read_chunks
    from batchmlx.batches.intake import submit as submit_batch

    rec = _run(
        lambda store, settings: submit_batch(
            store, settings, read_chunks(file), filename=file.name, now=time.time(),
            model=model, completion_window=completion_window, metadata=meta,
            output_expires_after=output_expires_after,
        )
    )  # fmt: skip
    if rec.status is BatchStatus.FAILED:
        _show(rec, as_json)
        raise typer.Exit(1)
    if wait:
        _warn_if_slow_blas()
        rec = _wait(rec.id, EngineSettings(simple=simple, max_batch_size=max_batch_size), as_json)
    _show(rec, as_json)
    if wait and rec.status is not BatchStatus.COMPLETED:
        raise typer.Exit(1)


def _wait(batch_id: str, engine: EngineSettings, quiet: bool) -> BatchRecord:
    """Follow a batch to its end; with no live worker, run one in this process."""
    from batchmlx.cli_progress import REFRESH_S, ProgressView
    from batchmlx.ingest import INBOX_HOOKS
    from batchmlx.store import Store
    from batchmlx.worker import WorkerOptions, run_worker

    settings = load_settings()

    async def main() -> BatchRecord:
        store = await Store.from_settings(settings)
        try:
            live = await store.live_workers(store.clock(), settings.lease_s)
            progress = ProgressView(store, batch_id, quiet)
            if live:
                while not (await store.get_batch(batch_id)).status.terminal:
                    await progress.show()
                    await asyncio.sleep(REFRESH_S)
            else:
                opts = WorkerOptions(until_idle=True, engine=engine)
                task = asyncio.create_task(progress.run())
                try:
                    await run_worker(settings, opts, store=store, finalize_hooks=INBOX_HOOKS)
                finally:
                    task.cancel()
            await progress.show(final=True)
            return await store.get_batch(batch_id)
        finally:
            await store.close()

    return asyncio.run(main())


# -- status, list, results, cancel -------------------------------------------------------------


@app.command()
def status(
    batch_id: Annotated[str | None, typer.Argument(help="One batch; all when omitted")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print OpenAI Batch object(s)")] = False,
    limit: int = 20,
) -> None:
    """Show batches: a table, or one batch in detail."""
    if batch_id is None:
        list_(as_json=as_json, limit=limit)
        return

    from batchmlx.batches.finalize import get_batch
    from batchmlx.batches.lifecycle import expire_unattended
    from batchmlx.ingest import INBOX_HOOKS

    async def current(store, settings) -> BatchRecord:
        rec = await get_batch(store, batch_id)
        return await expire_unattended(store, settings, rec, now=store.clock(), hooks=INBOX_HOOKS)

    rec = _run(current)
    _show(rec, as_json)


@app.command("list")
def list_(
    as_json: Annotated[bool, typer.Option("--json", help="Print OpenAI Batch objects")] = False,
    limit: int = 20,
) -> None:
    """List batches, newest first."""
    recs = _run(lambda store, settings: store.list_batches(limit=limit))
    if as_json:
        _print_json([batch_object(r) for r in recs])
        return
    if not recs:
        typer.echo("no batches")
    for r in recs:
        typer.echo(_summary(r))


@app.command()
def results(
    batch_id: str,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write here, not stdout")
    ] = None,
    errors: Annotated[bool, typer.Option("--errors", help="The error file instead")] = False,
) -> None:
    """Download a finished batch's output file (or, with --errors, its error file)."""

    async def fetch(store, settings) -> int:
        from batchmlx.batches.errors import BatchError
        from batchmlx.batches.files import iter_file_content
        from batchmlx.batches.finalize import get_batch
        from batchmlx.store.blobs import LocalBlobs

        rec = await get_batch(store, batch_id)
        if not rec.status.terminal:
            raise BatchError(f"batch {batch_id} is {rec.status.value}; not finished yet")
        chunks = iter_file_content(
            store, rec.error_file_id if errors else rec.output_file_id
        )
        if output is not None:  # streamed to a temp file, fsynced, renamed
            return (await LocalBlobs(output.parent).put(output.name, chunks))[0]
        size = 0
        async for chunk in chunks:
            sys.stdout.buffer.write(chunk)
            size += len(chunk)
        sys.stdout.buffer.flush()
        return size

    size = _run(fetch)
    if output is not None:
        typer.echo(f"wrote {size} bytes to {output}", err=True)


@app.command()
def cancel(batch_id: str, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Cancel a batch: running requests stop, finished results are kept."""
    from batchmlx.batches.lifecycle import cancel_unattended
    from batchmlx.ingest import INBOX_HOOKS

    rec = _run(lambda store, settings: cancel_unattended(
        store, settings, batch_id, now=store.clock(), hooks=INBOX_HOOKS))  # fmt: skip
    _show(rec, as_json)


# -- worker ----------------------------------------------------------------------------------


@app.command()
def worker(
    until_idle: Annotated[bool, typer.Option(help="Exit when nothing is left to do")] = False,
    model: Annotated[str | None, typer.Option(help="Serve every batch with this model")] = None,
    simple: SimpleOpt = ENGINE_DEFAULTS.simple,
    max_batch_size: MaxBatchOpt = ENGINE_DEFAULTS.max_batch_size,
    adaptive_width: AdaptiveWidthOpt = ENGINE_DEFAULTS.adaptive_width,
    block_size: BlockSizeOpt = ENGINE_DEFAULTS.block_size,
    use_paged_cache: PagedCacheOpt = ENGINE_DEFAULTS.use_paged_cache,
    cache_memory_mb: CacheMemoryMbOpt = ENGINE_DEFAULTS.cache_memory_mb,
    cache_memory_percent: Annotated[
        float, typer.Option(help="KV memory bound as a share of available memory")
    ] = ENGINE_DEFAULTS.cache_memory_percent,
    memory_aware_cache: Annotated[
        bool, typer.Option(help="Bound the cache by memory; off: by --cache-max-blocks")
    ] = ENGINE_DEFAULTS.memory_aware,
    cache_max_blocks: Annotated[
        int, typer.Option(help="Block bound without memory awareness")
    ] = ENGINE_DEFAULTS.cache_max_blocks,
    dtype: DtypeOpt = "auto",
    max_attempts: Annotated[
        int, typer.Option(help="Runs of one request (each ended by a crash) before giving up")
    ] = 3,
    inbox: Annotated[
        Path | None, typer.Option(help="Also watch this folder: each *.jsonl becomes a batch")
    ] = None,
    inbox_settle: Annotated[
        float, typer.Option(help="Seconds an inbox file must stay unchanged to be complete")
    ] = 1.0,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics at http://HOST:PORT/metrics")
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address for --metrics-port")] = "127.0.0.1",
    only_model: Annotated[
        list[str] | None,
        typer.Option(help="Claim only batches of this model (repeatable); others are left to "
                     "workers that serve them"),
    ] = None,
) -> None:
    """Run a long-lived worker that processes queued batches."""
    import logging

    from batchmlx.ingest import INBOX_HOOKS
    from batchmlx.worker import WorkerOptions, run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from batchmlx.accel import active_blas

    logging.getLogger("batchmlx.worker").info("BLAS: %s", active_blas().note)
    _warn_if_slow_blas()
    engine = EngineSettings(
        simple=simple,
        max_batch_size=max_batch_size,
        adaptive_width=adaptive_width,
        block_size=block_size,
        use_paged_cache=use_paged_cache,
        cache_memory_mb=cache_memory_mb,
        cache_memory_percent=cache_memory_percent,
        memory_aware=memory_aware_cache,
        cache_max_blocks=cache_max_blocks,
    )
    opts = WorkerOptions(
        until_idle=until_idle, model=model, dtype=dtype, engine=engine, max_attempts=max_attempts,
        only_models=tuple(only_model or ()),
    )
    settings = load_settings()
    box = None
    if inbox is not None:
        from batchmlx.ingest.inbox import Inbox

        box = Inbox(settings, inbox, settle_s=inbox_settle)
    from batchmlx.store import StoreUnavailable

    work = run_worker(settings, opts, inbox=box, finalize_hooks=INBOX_HOOKS)
    if metrics_port is not None:
        from batchmlx.worker.metrics import serve_metrics, with_queue_metrics

        serve_metrics(metrics_port, metrics_host)
        work = with_queue_metrics(settings, work)
    try:
        asyncio.run(work)
    except StoreUnavailable as exc:
        raise _fail(str(exc)) from None


@app.command()
def watch(
    folder: Annotated[Path, typer.Argument(help="The inbox folder (created if missing)")],
    settle: Annotated[
        float, typer.Option(help="Seconds a file must stay unchanged to be complete")
    ] = 1.0,
    force: Annotated[bool, typer.Option(help="Submit files whose content was seen before")] = False,
    model: Annotated[str | None, typer.Option(help="Submit every file with this model")] = None,
    completion_window: Annotated[str, typer.Option(help="e.g. 24h, 90m, 2d")] = "24h",
) -> None:
    """Watch a folder and turn each *.jsonl dropped there into a batch (no worker)."""
    import logging
    import signal

    from batchmlx.ingest.inbox import Inbox
    from batchmlx.store import Store

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = load_settings()
    box = Inbox(settings, folder, settle_s=settle, force=force, model=model,
                completion_window=completion_window)  # fmt: skip

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        store = await Store.from_settings(settings)
        try:
            await box.run(store, stop)
        finally:
            await store.close()

    asyncio.run(main())


@app.command()
def doctor(
    measure: Annotated[bool, typer.Option(help="Time a 1024x1024 float32 matmul")] = True,
) -> None:
    """Say which BLAS and device MLX runs with here, and how fast a matmul runs."""
    from batchmlx.accel import doctor_report

    _print_json(doctor_report(measure=measure))


# -- serve -----------------------------------------------------------------------------------


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="BATCHMLX_API_KEY", help="Require 'Authorization: Bearer KEY'"),
    ] = None,
    allow_remote: Annotated[
        bool, typer.Option(help="Bind a non-loopback address without an API key")
    ] = False,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(help="Also answer to this Host name (a proxy's, the machine's); repeatable"),
    ] = None,
    worker: Annotated[
        bool, typer.Option(help="Run the worker in this process (--no-worker: API only)")
    ] = True,
    model: Annotated[
        str, typer.Option(help="Serve every batch and online request with this model")
    ] = "default",
    stream_interval: Annotated[
        int, typer.Option(min=1, help="Streamed tokens per chunk (1: every token)")
    ] = 1,
    max_upload_mb: Annotated[int, typer.Option(min=1, help="Largest file upload")] = 200,
    simple: SimpleOpt = ENGINE_DEFAULTS.simple,
    max_batch_size: MaxBatchOpt = ENGINE_DEFAULTS.max_batch_size,
    adaptive_width: AdaptiveWidthOpt = ENGINE_DEFAULTS.adaptive_width,
    block_size: BlockSizeOpt = ENGINE_DEFAULTS.block_size,
    use_paged_cache: PagedCacheOpt = ENGINE_DEFAULTS.use_paged_cache,
    cache_memory_mb: CacheMemoryMbOpt = ENGINE_DEFAULTS.cache_memory_mb,
    dtype: DtypeOpt = "auto",
) -> None:
    """Serve the OpenAI-compatible HTTP API (Files, Batches, chat/completions, models)."""
    from batchmlx.server.auth import RemoteBindError, check_bind

    _warn_if_slow_blas()
    try:
        check_bind(host, api_key, allow_remote)
    except RemoteBindError as exc:
        raise _fail(str(exc)) from None
    from batchmlx.server.app import serve as run_server
    from batchmlx.server.context import ServerOptions
    from batchmlx.worker import WorkerOptions

    engine = EngineSettings(
        simple=simple, max_batch_size=max_batch_size, adaptive_width=adaptive_width,
        block_size=block_size, use_paged_cache=use_paged_cache, cache_memory_mb=cache_memory_mb,
    )  # fmt: skip
    options = ServerOptions(
        model=model,
        api_key=api_key,
        max_upload_bytes=max_upload_mb * 1024 * 1024,
        allowed_hosts=tuple(allowed_host or ()),
        stream_interval=stream_interval,
        worker=WorkerOptions(model=model, dtype=dtype, engine=engine) if worker else None,
    )
    try:
        run_server(load_settings(), options, host=host, port=port)
    except ValueError as exc:
        raise _fail(str(exc)) from None


# commands that never load a model: no re-execution onto the fast BLAS (about 0.5 s each)
_NO_MODEL_COMMANDS = frozenset({"status", "list", "results", "cancel", "watch"})


def runs_model(argv: list[str]) -> bool:
    """Whether this command line (global options hoisted first) may run a model: a worker,
    the server, doctor, `submit --wait`. No command (help): no; an unknown one: yes."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] == "--database-url" else 1
    if i >= len(argv):
        return False
    command, rest = argv[i], argv[i + 1 :]
    if command == "submit":
        flags = [a for a in rest if a in ("--wait", "--no-wait")]
        return bool(flags) and flags[-1] == "--wait"  # the last one given wins, as in click
    return command not in _NO_MODEL_COMMANDS


def main() -> None:  # pragma: no cover - the console script
    """Entry point: on Linux, a command that may run a model first moves onto a fast BLAS
    (re-executes once); then the CLI. Not inside `app`, so tests that call the app in-process
    never re-execute pytest."""
    # a command imports its libraries once and keeps them: a rarer first-generation collection
    # spares the collector walking that import graph again and again (~60 ms of a submit,
    # ~20 ms of a results command, measured)
    gc.set_threshold(10_000, 10, 10)
    argv = _hoist_database_url(sys.argv[1:])
    if runs_model(argv):
        from batchmlx.accel import ensure_fast_blas

        ensure_fast_blas()
    try:
        app(args=argv)
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    _exit(code)


def _exit(code: int | str | None) -> None:  # pragma: no cover - ends the process
    """Exit without the interpreter's teardown, which frees a loaded model and its KV cache
    object by object (about 0.2 s, measured) where the OS reclaims the memory at once. Exit
    handlers (logging's flush among them) still run; with other threads that may be working
    alive, a normal exit."""
    import atexit

    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    if _working_threads():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said on it
            pass
    os._exit(code or 0)


def _working_threads() -> list[threading.Thread]:
    """Threads other than this one that a fast exit could cut short: not daemons (a normal
    exit does not wait for those either) and not the engine's host-kernel pool, which is idle
    between steps (a step waits for its jobs). Measured: that pool kept every `submit --wait`
    on the slow exit, about 0.5 s."""
    host = sys.modules.get("batchmlx.engine.kernels.host_attention")
    pool = host.THREAD_NAME if host is not None else None
    return [
        t
        for t in threading.enumerate()
        if t is not threading.current_thread()
        and not t.daemon
        and not (pool and t.name.startswith(pool))
    ]


if __name__ == "__main__":  # pragma: no cover
    main()
