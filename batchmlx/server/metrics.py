"""/metrics: this process's Prometheus registry (the in-process worker's engine metrics) with
queue depths read from the store at each scrape."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from batchmlx.server.context import ServerContext
from batchmlx.worker.metrics import REGISTRY, refresh_queue


async def metrics(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    await refresh_queue(ctx.store)
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


ROUTES = [Route("/metrics", metrics, methods=["GET"])]
