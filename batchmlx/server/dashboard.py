"""The dashboard: a page at `/` (static files shipped in the package, no build step, no CDN) and
the JSON it polls once a second.

The page and its files hold no data, so they load without the API key; everything they show
comes from `/dashboard/api/*` and the OpenAI endpoints, with the key as a bearer token.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from batchmlx.core.progress import RateMeter, batch_meter, estimate_batch
from batchmlx.core.records import BatchRecord
from batchmlx.formats.openai import batch_object
from batchmlx.server.context import ServerContext
from batchmlx.server.errors import not_found
from batchmlx.worker.metrics import SERIES, inflight_tokens

STATIC_PACKAGE = ("batchmlx.server", "static")
MAX_BATCHES = 50  # the list shows the newest this many
ERROR_LINES = 20  # a batch's page shows the first this many lines of its error file
CHART_SECONDS = 300
# the page runs only its own files: no inline script, nothing from elsewhere
CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)


def is_public(path: str) -> bool:
    """The page and its static files: no data in them, so no key needed to load them."""
    return path == "/" or path.startswith("/static/")


class Meters:
    """One rate meter per running batch, fed by each poll of the page (a sample per look)."""

    def __init__(self) -> None:
        self.by_batch: dict[str, RateMeter] = {}

    def get(self, rec: BatchRecord) -> RateMeter:
        meter = self.by_batch.get(rec.id)
        if meter is None:
            meter = self.by_batch[rec.id] = batch_meter(rec)
        return meter

    def prune(self, keep: set[str]) -> None:
        for batch_id in [b for b in self.by_batch if b not in keep]:
            del self.by_batch[batch_id]


def _meters(request: Request) -> Meters:
    state = request.app.state
    if not hasattr(state, "dashboard_meters"):
        state.dashboard_meters = Meters()
    return state.dashboard_meters


def batch_view(
    rec: BatchRecord, now: float, meter: RateMeter | None, inflight: dict[str, int]
) -> dict[str, Any]:
    """The Batch object plus what the page shows beside it."""
    c, u = rec.request_counts, rec.usage
    done = c.completed + c.failed
    est = estimate_batch(rec, now, meter, inflight.get(rec.id, 0))
    obj = batch_object(rec)
    obj["dashboard"] = {
        "done": done,
        "progress": done / c.total if c.total else (1.0 if rec.status.terminal else 0.0),
        "tokens_per_s": est.tokens_per_s,
        "eta_s": est.eta_s,
        "cached_tokens": u.cached_tokens,
        "cache_hit_rate": u.cached_tokens / u.input_tokens if u.input_tokens else None,
        # counted live from the requests: a running or cancelling batch has them too
        "outcomes": {
            "hits": rec.outcomes.hits,
            "prefix_hits": rec.outcomes.prefix_hits,
            "misses": rec.outcomes.misses,
        },  # fmt: skip
    }
    return obj


async def index(request: Request) -> Response:
    html = resources.files(STATIC_PACKAGE[0]).joinpath(STATIC_PACKAGE[1], "index.html")
    return Response(
        html.read_bytes(),
        media_type="text/html; charset=utf-8",
        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"},
    )


async def summary(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    now = time.time()
    meters = _meters(request)
    recs = await ctx.store.list_batches(limit=MAX_BATCHES)
    running = {r.id for r in recs if not r.status.terminal}
    meters.prune(running)
    live = inflight_tokens()
    batches = [batch_view(r, now, meters.get(r) if r.id in running else None, live) for r in recs]
    latest = SERIES.latest
    return JSONResponse({
        "now": now,
        "model": ctx.model_name,
        "worker": ctx.worker_alive,
        "engine": {
            "running": latest.running,
            "blocks_in_use": latest.blocks_in_use,
            "blocks_cached": latest.blocks_cached,
            "blocks_free": latest.blocks_free,
        },
        "series": SERIES.window(now, CHART_SECONDS),
        "batches": batches,
    })  # fmt: skip


async def batch_detail(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    batch_id = request.path_params["batch_id"]
    rec = await ctx.store.get_batch(batch_id)
    if rec is None:
        raise not_found("batch", batch_id)
    meter = None if rec.status.terminal else _meters(request).get(rec)
    view = batch_view(rec, time.time(), meter, inflight_tokens())
    head = await _error_head(ctx, rec)
    # a batch whose error file was deleted or expired still has its page, saying so
    view["error_file_missing"] = head is None
    view["error_lines"] = _error_lines(head or b"")
    return JSONResponse(view)


async def _error_head(ctx: ServerContext, rec: BatchRecord) -> bytes | None:
    """The start of the error file, up to its ERROR_LINES-th line (b"" when the batch has
    none); None when the file or its bytes are gone."""
    if rec.error_file_id is None:
        return b""
    f = await ctx.store.get_file(rec.error_file_id)
    if f is None:
        return None
    data = bytearray()
    chunks = ctx.store.read_file(f)
    try:
        async for chunk in chunks:
            data += chunk  # only as far as the lines shown: an error file may be 200 MB
            if data.count(b"\n") >= ERROR_LINES:
                break
    except FileNotFoundError:  # deleted meanwhile, or its bytes gone from files/
        return None
    finally:
        await chunks.aclose()
    return bytes(data)


def _error_lines(data: bytes) -> list[dict[str, Any]]:
    """The first ERROR_LINES lines of an error file, as custom_id, status and message."""
    out = []
    for raw in data.splitlines()[:ERROR_LINES]:
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue  # not one of ours (a file replaced by hand): shown as absent
        if not isinstance(line, dict):
            continue
        err = line.get("error") or {}
        resp = line.get("response") or {}
        body_err = (resp.get("body") or {}).get("error") or {}
        out.append({
            "custom_id": line.get("custom_id"),
            "status_code": resp.get("status_code"),
            "code": err.get("code") or body_err.get("code") or body_err.get("type"),
            "message": err.get("message") or body_err.get("message"),
        })  # fmt: skip
    return out


ROUTES = [
    Route("/", index, methods=["GET"]),
    Route("/dashboard/api/summary", summary, methods=["GET"]),
    Route("/dashboard/api/batches/{batch_id}", batch_detail, methods=["GET"]),
    Mount("/static", StaticFiles(packages=[STATIC_PACKAGE]), name="static"),
]
