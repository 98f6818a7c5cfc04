"""The command line: parse, call batches/, the store, the worker or the server, print. Imports no
MLX at import time, nor the store (SQLAlchemy, Alembic: about 0.4 s): the console script decides
first whether to re-execute onto the fast BLAS (`entry.main`), and each command imports what it
runs.

    app.py             the typer app: --database-url into Settings, the list of commands
    batch_commands.py  submit (and --wait), status, list, results, cancel
    serving.py         worker, watch, serve, doctor
    engine_options.py  the engine options worker, serve and submit --wait share
    show.py            how a batch is printed
    progress.py        submit --wait's progress bar (tokens/s, ETA)
    entry.py           the console script: fast BLAS re-exec, quick exit
"""

from batchmlx.cli.app import app
from batchmlx.cli.entry import main, runs_model

__all__ = ["app", "main", "runs_model"]
