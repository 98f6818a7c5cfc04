"""The Starlette app: routes, the lifespan that runs the validator and the worker, and `serve`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from batchmlx.batches.errors import BatchError
from batchmlx.batches.models import chosen_override, rule_of, serving_rule
from batchmlx.config import Settings
from batchmlx.core.models import resolve_model
from batchmlx.ingest import INBOX_HOOKS
from batchmlx.server import batches, dashboard, files, metrics, online
from batchmlx.server.auth import BearerAuth
from batchmlx.server.context import ServerContext, ServerOptions, Validator, log
from batchmlx.server.errors import EXCEPTION_HANDLERS
from batchmlx.server.guard import HostPolicy, RequestGuard
from batchmlx.store import Store


async def list_models(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    model = {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "batchmlx"}
    return JSONResponse({"object": "list", "data": [model]})


class _CurrentWorker:
    """What handlers reach as `ctx.worker`: the supervisor's current worker."""

    def __init__(self, supervisor) -> None:
        self._supervisor = supervisor

    def __getattr__(self, name: str):
        return getattr(self._supervisor.worker, name)


def create_app(settings: Settings, options: ServerOptions, *, host: str) -> Starlette:
    """The app for a server bound to `host` (which decides the Host names it answers to)."""
    try:  # the submit-time check (a GGUF's header among it): a file it cannot serve fails here
        chosen_override(options.model, rule_of(settings))
    except BatchError as exc:
        raise ValueError(f"--model: {exc}") from None
    spec = resolve_model(options.model, cache_dir=settings.cache_dir)
    if spec is None:
        raise ValueError(f"model {options.model!r} cannot be resolved")
    rule = serving_rule(settings, options.model)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = await Store.from_settings(settings)
        validator = Validator(store, settings, rule, options.validate_poll_s)
        # the server finalizes (cancel, expiry with no worker; its worker): with the inbox's
        # result copies, as every process that may finalize
        ctx = ServerContext(store, settings, options, validator, spec.name,
                            finalize_hooks=INBOX_HOOKS)  # fmt: skip
        app.state.ctx = ctx
        ctx.tasks.append(asyncio.create_task(validator.run()))
        supervisor = None
        if options.worker is not None:
            from batchmlx.server.supervisor import Supervisor
            from batchmlx.worker import Worker

            worker_options = options.worker.taking_online()  # online requests come here

            async def new_worker() -> Worker:
                worker = Worker(store, settings, worker_options, finalize_hooks=ctx.finalize_hooks)
                t0 = time.perf_counter()
                # on the worker's engine thread (the loop stays free); before listening at
                # start, so ready means loaded
                ctx.model_name = await worker.load_async(options.model)
                log.info("model %s loaded in %.1fs", ctx.model_name, time.perf_counter() - t0)
                return worker

            give_up = getattr(app.state, "shutdown", lambda: None)
            supervisor = Supervisor(await new_worker(), new_worker, on_give_up=give_up)
            app.state.supervisor = supervisor
            ctx.worker = _CurrentWorker(supervisor)
            ctx.worker_task = asyncio.create_task(supervisor.run())
        try:
            yield
        finally:
            for t in ctx.tasks:
                t.cancel()
            if supervisor is not None and ctx.worker_task is not None:
                supervisor.stop()  # the worker finishes its step, releases leases
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ctx.worker_task, 30)
            await asyncio.gather(*ctx.tasks, return_exceptions=True)
            await store.close()

    routes = [
        *files.ROUTES,
        *batches.ROUTES,
        *online.ROUTES,
        Route("/v1/models", list_models, methods=["GET"]),
        *metrics.ROUTES,
        *dashboard.ROUTES,
    ]
    hosts = HostPolicy.for_bind(host, api_key=options.api_key, extra=options.allowed_hosts)
    middleware = [Middleware(RequestGuard, policy=hosts)]
    if options.api_key:
        middleware.append(
            Middleware(BearerAuth, api_key=options.api_key, public=dashboard.is_public)
        )
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )


def serve(settings: Settings, options: ServerOptions, *, host: str, port: int) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = create_app(settings, options, host=host)
    # one process, one event loop for the handlers and the worker's database work; the engine
    # steps on the worker's own thread (worker/engine_thread.py)
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5,
        lifespan="on",
    ))  # fmt: skip
    app.state.shutdown = lambda: setattr(server, "should_exit", True)  # graceful, as SIGTERM
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        raise SystemExit(3)  # uvicorn.run's STARTUP_FAILURE: the lifespan or the bind failed
    supervisor = getattr(app.state, "supervisor", None)
    if supervisor is not None and supervisor.failed:
        raise SystemExit("the worker could not be kept running; see the log above")
