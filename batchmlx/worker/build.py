"""Build an engine and its translator for a model name: the wiring of engine and formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build_engine(name: str, *, cache_dir: Path, dtype: str = "auto", **engine_cfg: Any):
    """Load the model `name` and wrap it in an Engine and the Translator that feeds it."""
    from batchmlx.engine.llm_engine import Engine, EngineConfig
    from batchmlx.engine.loader import load_model, resolve_model
    from batchmlx.worker.translate import Translator

    spec = resolve_model(name, cache_dir=cache_dir)
    if spec is None:
        raise ValueError(f"model {name!r} cannot be resolved")
    loaded = load_model(spec, cache_dir=cache_dir, dtype=dtype)
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        context_length=loaded.context_length,
        config=EngineConfig(**engine_cfg),
    )
    translator = Translator(
        loaded.tokenizer, loaded.spec.name, loaded.context_length, loaded.eos_token_ids,
        grammar_check=engine.grammars.check,
    )
    return engine, translator
