"""The model rule's options (docs/models.md), on every command that takes batches or requests:
`submit`, `watch`, `worker` (its --inbox) and `serve`."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from batchmlx.cli.common import fail
from batchmlx.config import Settings
from batchmlx.core.model_rule import MODEL_ALIASES_ENV, STRICT_MODELS_ENV, parse_aliases

StrictModelsOpt = Annotated[
    bool | None,
    typer.Option("--strict-models/--no-strict-models", show_default=False,
                 help="Refuse a model name that is no model here (OpenAI's model_not_found) "
                 f"instead of serving it with the serving model (${STRICT_MODELS_ENV}=1)"),
]  # fmt: skip
ModelAliasOpt = Annotated[
    list[str] | None,
    typer.Option("--model-alias", metavar="NAME=MODEL",
                 help="Serve the model name NAME with MODEL ('default', a folder, a .gguf "
                 f"file, a hub id); repeatable; ${MODEL_ALIASES_ENV}=NAME=MODEL,…"),
]  # fmt: skip


def with_model_rule(settings: Settings, strict: bool | None, aliases: list[str] | None) -> Settings:
    """The settings with the command's --strict-models and --model-alias over the environment's
    (an alias of the command line wins over one of the same name there)."""
    try:
        given = parse_aliases(aliases or ())
    except ValueError as exc:
        raise fail(str(exc)) from None
    merged = {**dict(settings.model_aliases), **given}
    return dataclasses.replace(
        settings,
        strict_models=settings.strict_models if strict is None else strict,
        model_aliases=tuple(merged.items()),
    )
