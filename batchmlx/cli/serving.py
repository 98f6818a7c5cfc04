"""The commands that run: a worker, the inbox watcher, the HTTP server, and doctor (the BLAS and
device MLX runs with here). Each builds its options and hands them, with the settings, to the
worker, ingest or server package."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from batchmlx.cli.common import (
    check_port_free,
    fail,
    print_json,
    run_with_store,
    settings_of,
    warn_if_slow_blas,
)
from batchmlx.cli.engine_options import EngineChoice, engine_options
from batchmlx.cli.model_options import ModelAliasOpt, StrictModelsOpt, with_model_rule
from batchmlx.config import RETENTION_DAYS_ENV, Settings

LOG_FORMAT = "%(asctime)s %(name)s %(message)s"

RetentionOpt = Annotated[
    float | None,
    typer.Option(
        min=0,
        metavar="DAYS",
        help="Purge batches that finished more than DAYS ago "
        f"(rows and files; ${RETENTION_DAYS_ENV}); default: kept until deleted",
    ),
]


def _with_retention(settings: Settings, days: float | None) -> Settings:
    return settings if days is None else dataclasses.replace(settings, retention_days=days)


@engine_options
def worker(
    ctx: typer.Context,
    until_idle: Annotated[bool, typer.Option(help="Exit when nothing is left to do")] = False,
    model: Annotated[str | None, typer.Option(help="Serve every batch with this model")] = None,
    max_attempts: Annotated[
        int,
        typer.Option(min=1, help="Runs of one request (each ended by a crash) before giving up"),
    ] = 3,
    inbox: Annotated[
        Path | None, typer.Option(help="Also watch this folder: each *.jsonl becomes a batch")
    ] = None,
    inbox_settle: Annotated[
        float, typer.Option(min=0, help="Seconds an inbox file must stay unchanged to be complete")
    ] = 1.0,
    metrics_port: Annotated[
        int | None,
        typer.Option(min=1, max=65535, help="Serve Prometheus metrics at http://HOST:PORT/metrics"),
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address for --metrics-port")] = "127.0.0.1",
    only_model: Annotated[
        list[str] | None,
        typer.Option(
            help="Claim only batches of this model (repeatable); others are left to "
            "workers that serve them"
        ),
    ] = None,
    retention_days: RetentionOpt = None,
    strict_models: StrictModelsOpt = None,
    model_alias: ModelAliasOpt = None,
    progress_every: Annotated[
        float,
        typer.Option(min=0.1, metavar="SECONDS", help="Log a running batch's progress this often"),
    ] = 30.0,
    *,
    engine: EngineChoice,
) -> None:
    """Run a long-lived worker that processes queued batches (one log line when it takes a
    batch up, its progress every --progress-every seconds, one when it ends)."""
    import logging

    from batchmlx.engine.host.fast_blas import active_blas
    from batchmlx.ingest import INBOX_HOOKS
    from batchmlx.store import StoreUnavailable
    from batchmlx.worker import WorkerOptions, run_worker

    settings = _with_retention(settings_of(ctx), retention_days)
    settings = with_model_rule(settings, strict_models, model_alias)  # its --inbox's files
    if model is not None:  # a file it cannot serve fails here, not each line of a batch
        from batchmlx.batches.errors import BatchError
        from batchmlx.batches.models import chosen_override, rule_of

        try:
            chosen_override(model, rule_of(settings))
        except BatchError as exc:
            raise fail(f"--model: {exc}") from None
    if metrics_port is not None:  # a port in use fails here, in one line, before any work
        _serve_metrics(metrics_port, metrics_host)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("batchmlx.worker").info("BLAS: %s", active_blas().note)
    warn_if_slow_blas(engine.dtype, settings.cpu)
    opts = WorkerOptions(
        until_idle=until_idle, model=model, dtype=engine.dtype, engine=engine.settings,
        max_attempts=max_attempts, only_models=tuple(only_model or ()),
        progress_every_s=progress_every,
    )  # fmt: skip
    box = None
    if inbox is not None:
        from batchmlx.ingest.inbox import Inbox

        box = Inbox(settings, inbox, settle_s=inbox_settle)
    work = run_worker(settings, opts, inbox=box, finalize_hooks=INBOX_HOOKS)
    if metrics_port is not None:
        from batchmlx.worker.metrics import with_queue_metrics

        work = with_queue_metrics(settings, work)
    try:
        asyncio.run(work)
    except StoreUnavailable as exc:
        raise fail(str(exc)) from None


def _serve_metrics(port: int, host: str) -> None:
    from batchmlx.worker.metrics import serve_metrics

    try:
        serve_metrics(port, host)
    except OSError as exc:  # in use, no such address
        why = exc.strerror or str(exc)
        raise fail(f"cannot listen on {host}:{port} (--metrics-port): {why}") from None


async def _opened(store: object) -> None:
    """Nothing: the store opened (and migrated) is the check."""


def watch(
    ctx: typer.Context,
    folder: Annotated[Path, typer.Argument(help="The inbox folder (created if missing)")],
    settle: Annotated[
        float, typer.Option(min=0, help="Seconds a file must stay unchanged to be complete")
    ] = 1.0,
    force: Annotated[bool, typer.Option(help="Submit files whose content was seen before")] = False,
    model: Annotated[str | None, typer.Option(help="Submit every file with this model")] = None,
    completion_window: Annotated[str, typer.Option(help="e.g. 24h, 90m, 2d")] = "24h",
    strict_models: StrictModelsOpt = None,
    model_alias: ModelAliasOpt = None,
) -> None:
    """Watch a folder and turn each *.jsonl dropped there into a batch (no worker)."""
    import logging
    import signal

    from batchmlx.ingest.inbox import Inbox
    from batchmlx.store import Store

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    settings = with_model_rule(settings_of(ctx), strict_models, model_alias)
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


def doctor(
    ctx: typer.Context,
    measure: Annotated[bool, typer.Option(help="Time a 1024x1024 float32 matmul")] = True,
) -> None:
    """Say which BLAS and device MLX runs with here, and how fast a matmul runs."""
    from batchmlx.engine.host.fast_blas import doctor_report

    print_json(doctor_report(measure=measure, threads=settings_of(ctx).cpu.threads))


@engine_options
def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to bind")] = 8000,
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
        str,
        typer.Option(
            help="The model this server runs: it answers every batch and online "
            "request, whatever model they name (unless --strict-models)"
        ),
    ] = "default",
    stream_interval: Annotated[
        int, typer.Option(min=1, help="Streamed tokens per chunk (1: every token)")
    ] = 1,
    max_upload_mb: Annotated[int, typer.Option(min=1, help="Largest file upload")] = 200,
    retention_days: RetentionOpt = None,
    strict_models: StrictModelsOpt = None,
    model_alias: ModelAliasOpt = None,
    *,
    engine: EngineChoice,
) -> None:
    """Serve the OpenAI-compatible HTTP API, with a worker in the same process.

    \b
    Files      POST /v1/files, GET /v1/files, GET /v1/files/{file_id},
               DELETE /v1/files/{file_id}, GET /v1/files/{file_id}/content
    Batches    POST /v1/batches, GET /v1/batches, GET /v1/batches/{batch_id},
               POST /v1/batches/{batch_id}/cancel
    Online     POST /v1/chat/completions, POST /v1/completions,
               POST /v1/responses, POST /v1/embeddings
    Models     GET /v1/models
    Metrics    GET /metrics (Prometheus)
    Dashboard  GET / (the page), GET /dashboard/api/summary,
               GET /dashboard/api/batches/{batch_id}
    """
    from batchmlx.server.auth import RemoteBindError, check_bind

    warn_if_slow_blas(engine.dtype, settings_of(ctx).cpu)
    try:
        check_bind(host, api_key, allow_remote)
    except RemoteBindError as exc:
        raise fail(str(exc)) from None
    settings = _with_retention(settings_of(ctx), retention_days)
    settings = with_model_rule(settings, strict_models, model_alias)
    # the port and the database checked here, so that either fails in one line, not in the
    # server's start-up traceback
    check_port_free(host, port, "--port")
    run_with_store(settings, _opened)
    from batchmlx.server.app import serve as run_server
    from batchmlx.server.context import ServerOptions
    from batchmlx.worker import WorkerOptions

    in_process = WorkerOptions(model=model, dtype=engine.dtype, engine=engine.settings)
    options = ServerOptions(
        model=model,
        api_key=api_key,
        max_upload_bytes=max_upload_mb * 1024 * 1024,
        allowed_hosts=tuple(allowed_host or ()),
        stream_interval=stream_interval,
        worker=in_process if worker else None,
    )
    try:
        run_server(settings, options, host=host, port=port)
    except ValueError as exc:
        raise fail(str(exc)) from None
