"""Which models are vision-language ones, and loading them through mlx-vlm."""

from __future__ import annotations

from typing import Any


def is_vision_model(kind: str, source: str) -> bool:
    """Whether a resolved model (core.models.ModelSpec's kind and source) is a vision-language
    one: its config.json has a `vision_config`. A hub id's config is read from the local hub
    cache, or fetched; one that cannot be read counts as text (the text loader says why)."""
    import json
    from pathlib import Path

    if kind == "mlx_dir":
        config = Path(source) / "config.json"
    elif kind == "hub":
        try:
            from huggingface_hub import hf_hub_download

            config = Path(hf_hub_download(source, "config.json"))
        except Exception:  # offline, gated, no such repo: the text path reports it
            return False
    else:
        return False
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def load_vision(path: str) -> tuple[Any, Any, dict[str, Any]]:
    """mlx-vlm's model and processor of a local folder or hub id, and its config."""
    try:
        from mlx_vlm import load
        from mlx_vlm.utils import load_config
    except ImportError as exc:
        raise ValueError(
            "this is a vision-language model: install batchmlx's vision extra "
            "(pip install 'batchmlx[vision]') to serve it"
        ) from exc
    model, processor = load(path)
    return model, processor, load_config(path)
