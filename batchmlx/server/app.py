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

from batchmlx.config import Settings
from batchmlx.models import resolve_model
from batchmlx.server import batches, files, online
from batchmlx.server.auth import BearerAuth
from batchmlx.server.context import ServerContext, ServerOptions, Validator, log
from batchmlx.server.errors import EXCEPTION_HANDLERS
from batchmlx.store import Store


async def list_models(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    model = {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "batchmlx"}
    return JSONResponse({"object": "list", "data": [model]})


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the worker stopped", exc_info=task.exception())


def create_app(settings: Settings, options: ServerOptions) -> Starlette:
    spec = resolve_model(options.model, cache_dir=settings.cache_dir)
    if spec is None:
        raise ValueError(f"model {options.model!r} cannot be resolved")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = await Store.from_settings(settings)
        validator = Validator(store, settings, options.model, options.validate_poll_s)
        ctx = ServerContext(store, settings, options, validator, spec.name)
        app.state.ctx = ctx
        ctx.tasks.append(asyncio.create_task(validator.run()))
        if options.worker is not None:
            from batchmlx.worker import Worker

            ctx.worker = Worker(store, settings, options.worker)
            t0 = time.perf_counter()
            ctx.model_name = ctx.worker.load(options.model)  # before listening: ready = loaded
            log.info("model %s loaded in %.1fs", ctx.model_name, time.perf_counter() - t0)
            ctx.worker_task = asyncio.create_task(ctx.worker.run())
            ctx.worker_task.add_done_callback(_log_crash)
        try:
            yield
        finally:
            for t in ctx.tasks:
                t.cancel()
            if ctx.worker is not None and ctx.worker_task is not None:
                ctx.worker.stop_requested = True  # finishes the step, releases leases
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ctx.worker_task, 30)
            await asyncio.gather(*ctx.tasks, return_exceptions=True)
            await store.close()

    routes = [
        *files.ROUTES,
        *batches.ROUTES,
        *online.ROUTES,
        Route("/v1/models", list_models, methods=["GET"]),
    ]
    middleware = [Middleware(BearerAuth, api_key=options.api_key)] if options.api_key else []
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )


def serve(settings: Settings, options: ServerOptions, *, host: str, port: int) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = create_app(settings, options)
    # one process, one event loop: the worker's engine steps and the handlers share it
    uvicorn.run(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5,
        lifespan="on",
    )  # fmt: skip
