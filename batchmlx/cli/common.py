"""What the commands share: the settings the app's callback parsed, the error exit and the one
line any error that ends a command is told in, the slow-BLAS warning, a port checked free, and
one store opened around one coroutine."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import typer

from batchmlx.config import HostSettings, Settings
from batchmlx.database_url import DatabaseUrlError, redact

# set to 1: an unexpected error shows its traceback too (for a bug report), not one line alone
TRACEBACK_ENV = "BATCHMLX_TRACEBACK"


def settings_of(ctx: typer.Context) -> Settings:
    """The settings the app's callback made from the command line (and the environment), their
    database URL checked (a bad one is one line, without its password)."""
    settings = ctx.find_object(Settings)
    if settings is None:  # a command run without the app around it
        raise RuntimeError("no settings: the app's callback sets them")
    try:
        settings.target  # noqa: B018 - parsed (and the password file read) for its errors
    except DatabaseUrlError as exc:
        raise fail(str(exc)) from None
    return settings


def fail(message: str, code: int = 1) -> typer.Exit:
    """Say `message` as the command's one error line (any URL's password hidden); the exit to
    raise."""
    one_line = " ".join(redact(message).split())
    typer.secho(f"error: {one_line}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def error_line(exc: BaseException) -> str:
    """What went wrong, in one line for a person: the database's error, the file and why, or the
    message of an error that has one; for any other, its type too."""
    db = sys.modules.get("sqlalchemy.exc")  # loaded whenever a database was touched
    if db is not None and isinstance(exc, db.DBAPIError):
        cause = str(exc.orig or exc).strip().splitlines() or [type(exc.orig).__name__]
        return f"the database failed: {cause[0]}"
    if isinstance(exc, OSError) and exc.strerror:
        where = exc.filename if exc.filename is not None else ""
        return f"{exc.strerror}: {where}" if where else exc.strerror
    if isinstance(exc, (ValueError, RuntimeError)) and str(exc):
        return str(exc)
    return f"unexpected {type(exc).__name__}: {exc} (${TRACEBACK_ENV}=1 shows where)"


def report_error(exc: BaseException) -> int:
    """Tell an error that ended a command in one line (the traceback only when asked for);
    the exit status."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    fail(error_line(exc))
    return 1


def check_port_free(host: str, port: int, option: str) -> None:
    """Fail in one line now if `host:port` cannot be listened on (in use, no such address),
    rather than in a server's traceback after start-up."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
            probe.bind(address)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise fail(f"cannot listen on {host}:{port} ({option}): {why}") from None


# the weights these --dtype values give on MLX's CPU backend have their GEMMs off MLX (oneDNN,
# or numpy's own BLAS: engine/host/linear.py), so its BLAS matters little to them
HOST_DTYPES = ("auto", "bfloat16", "int8", "q4")


def warn_if_slow_blas(dtype: str = "float32", host: HostSettings | None = None) -> None:
    """One loud line on stderr when MLX would run on the reference BLAS (engine/host/fast_blas.py)
    and the weights `dtype` gives would compute there. `host`: where oneDNN is (HostSettings)."""
    from batchmlx.engine.host.fast_blas import slow_blas_warning

    if dtype in HOST_DTYPES:
        from batchmlx.engine.host.backend import HostBackend

        if HostBackend(host).onednn_available():
            return
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
