"""The example batch files (`jobs/examples/` of the repository), found where this install keeps
them: a wheel ships them inside the package as `batchmlx/examples/` (setup.py maps the folder
there, as it does the migrations); a checkout, installed editable or run from its folder, reads
them in place. So `batchmlx submit --example` works from any folder, with or without a clone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from batchmlx.cli.common import fail

_PACKAGE = Path(__file__).resolve().parents[1]  # batchmlx/
FOLDERS = (_PACKAGE / "examples", _PACKAGE.parent / "jobs" / "examples")
DEFAULT_EXAMPLE = "chat"


def example_names() -> list[str]:
    for folder in FOLDERS:
        names = sorted(p.stem for p in folder.glob("*.jsonl"))
        if names:
            return names
    return []


def example_path(name: str = DEFAULT_EXAMPLE) -> Path:
    """The example file `name` (chat, completions); a clear error if this install lacks it."""
    for folder in FOLDERS:
        path = folder / f"{name}.jsonl"
        if path.is_file():
            return path
    known = ", ".join(example_names()) or "none: this install has no example files"
    raise fail(f"no example named {name!r} (examples: {known})")


def example(
    name: Annotated[
        str,
        typer.Argument(
            help="Which example: chat (8 chat requests), completions, or images "
            "(4 image requests, for a vision-language model)"
        ),  # fmt: skip
    ] = DEFAULT_EXAMPLE,
    path: Annotated[bool, typer.Option("--path", help="Print where the file is instead")] = False,
) -> None:
    """Print an example batch file (a start for your own: `batchmlx example > mine.jsonl`);
    `batchmlx submit --example --wait` runs the chat one."""
    found = example_path(name)
    if path:
        typer.echo(str(found))
    else:
        typer.echo(found.read_text(), nl=False)
