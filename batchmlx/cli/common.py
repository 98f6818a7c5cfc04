"""What the commands share: the settings the app's callback parsed, the error exit, the slow-BLAS
warning, and one store opened around one coroutine."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import typer

from batchmlx.config import Settings


def settings_of(ctx: typer.Context) -> Settings:
    """The settings the app's callback made from the command line (and the environment)."""
    settings = ctx.find_object(Settings)
    if settings is None:  # a command run without the app around it
        raise RuntimeError("no settings: the app's callback sets them")
    return settings


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def warn_if_slow_blas() -> None:
    """One loud line on stderr when MLX would run on the reference BLAS (see batchmlx.accel)."""
    from batchmlx.accel import slow_blas_warning

    line = slow_blas_warning()
    if line:
        typer.secho(line, fg=typer.colors.YELLOW, bold=True, err=True)


def run_with_store(settings: Settings, coro_fn: Callable[[Any], Awaitable[Any]]) -> Any:
    """Open the store, run one coroutine on it, close the store; its errors exit cleanly."""
    from batchmlx.batches.errors import BatchError
    from batchmlx.store import Store, StoreUnavailable

    async def main() -> Any:
        store = await Store.from_settings(settings)
        try:
            return await coro_fn(store)
        finally:
            await store.close()

    try:
        return asyncio.run(main())
    except (BatchError, StoreUnavailable) as exc:
        raise fail(str(exc)) from None


def print_json(obj: Any) -> None:
    sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")
