"""OpenAI's cursor pages: `?limit=&after=` (and `order=`), answered as
{"object": "list", "data", "first_id", "last_id", "has_more"}."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from batchmlx.server.errors import ApiError


def page_params(
    request: Request, *, default_limit: int, max_limit: int, orders: bool = False
) -> tuple[int, str | None, str]:
    q = request.query_params
    raw = q.get("limit")
    try:
        limit = default_limit if raw is None else int(raw)
    except ValueError:
        raise ApiError(400, f"Invalid 'limit': {raw!r} is not an integer.",
                       code="invalid_value", param="limit") from None  # fmt: skip
    if not 1 <= limit <= max_limit:
        raise ApiError(400, f"Invalid 'limit': expected 1 to {max_limit}, got {limit}.",
                       code="invalid_value", param="limit")  # fmt: skip
    order = q.get("order", "desc")
    if orders and order not in ("asc", "desc"):
        raise ApiError(400, f"Invalid 'order': {order!r}; expected 'asc' or 'desc'.",
                       code="invalid_value", param="order")  # fmt: skip
    return limit, q.get("after") or None, order


def page_response(items: list[dict[str, Any]], limit: int) -> JSONResponse:
    """`items` holds up to limit + 1 objects: the extra one only says there is more."""
    data = items[:limit]
    return JSONResponse({
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    })  # fmt: skip
