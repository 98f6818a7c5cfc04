"""Which `model` strings batchmlx can serve. No MLX import: validation and the CLI use it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_ALIAS = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the name response bodies show for it

# "org/name" as the Hugging Face hub spells repo ids; no network check here.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # what response bodies name: DEFAULT_MODEL_NAME or the string the user gave
    kind: str  # "default" | "mlx_dir" | "gguf" | "hub"
    source: str  # absolute path (mlx_dir, gguf), hub id (hub), or "" (default)


def resolve_model(spec: str, *, cache_dir: Path) -> ModelSpec | None:
    """Map a request's `model` string to something loadable, or None if we cannot serve it."""
    del cache_dir  # part of the signature so aliases may later depend on cached models
    spec = spec.strip()
    if not spec:
        return None
    if spec in (DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME):
        return ModelSpec(name=DEFAULT_MODEL_NAME, kind="default", source="")
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSpec(name=spec, kind="mlx_dir", source=str(path.resolve()))
        return None
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSpec(name=spec, kind="gguf", source=str(path.resolve()))
        return None
    if _HUB_ID.match(spec) and ".." not in spec:
        return ModelSpec(name=spec, kind="hub", source=spec)
    return None
