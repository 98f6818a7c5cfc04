"""The command line: parse, call batches/, the store, the worker or the server, print. Imports no
MLX at import time, nor the store (SQLAlchemy, Alembic: about 0.4 s): the console script puts a
command that runs a model on the fast BLAS first (`entry.main`), before it imports the typer app
(`app` here is loaded on first use), and each command imports what it runs.

    commands.py        the typer app: --database-url into Settings, the list of commands
    batch_commands.py  submit (and --wait), status, list, results, cancel
    serving.py         worker, watch, serve, doctor
    engine_options.py  the engine options worker, serve and submit --wait share
    show.py            how a batch is printed
    progress.py        submit --wait's progress bar (tokens/s, ETA)
    entry.py           the console script: fast BLAS, quick exit
"""

from typing import Any

from batchmlx.cli.entry import main, runs_model

__all__ = ["app", "main", "runs_model"]


def __getattr__(name: str) -> Any:
    # the app (typer, every command module: ~60-90 ms) only when asked for: the console script
    # may re-execute onto the fast BLAS before it needs it, and would import it twice
    if name == "app":
        from batchmlx.cli.commands import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
