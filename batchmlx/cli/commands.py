"""The typer app: the global `--database-url` and `--database-password-file`, parsed once into
the Settings every command is handed (through typer's context, not the environment), and the
list of commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from batchmlx.cli import batch_commands, examples, purge, serving
from batchmlx.config import DATABASE_URL_ENV, PASSWORD_FILE_ENV, load_settings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Local, OpenAI-Batch-compatible job processor for LLM requests on MLX.",
)


@app.callback()
def _options(
    ctx: typer.Context,
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            envvar=DATABASE_URL_ENV,
            help="The queue: sqlite:///FILE (default: $BATCHMLX_HOME/batchmlx.db) or "
            "postgresql://USER@HOST/DB, shared by workers on several hosts. Keep its password "
            "off the command line (ps shows it): --database-password-file, PGPASSWORD or "
            "~/.pgpass",
        ),
    ] = None,
    database_password_file: Annotated[
        Path | None,
        typer.Option(
            "--database-password-file",
            envvar=PASSWORD_FILE_ENV,
            help="A file whose first line is the PostgreSQL password (for a URL without one)",
        ),
    ] = None,
) -> None:
    """Local, OpenAI-Batch-compatible job processor for LLM requests on MLX."""
    ctx.obj = load_settings(database_url=database_url, password_file=database_password_file)


app.command()(batch_commands.submit)
app.command()(batch_commands.status)
app.command("list")(batch_commands.list_)
app.command()(batch_commands.results)
app.command()(batch_commands.cancel)
app.command()(purge.purge)
app.command()(serving.worker)
app.command()(serving.watch)
app.command()(serving.doctor)
app.command()(serving.serve)
app.command()(examples.example)
