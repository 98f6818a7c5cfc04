"""Build an engine and its translator for a model name: the wiring of engine and formats."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchmlx.config import HostSettings, MediaSettings
from batchmlx.core.engine_api import EmbedderProtocol, EngineProtocol, EngineSettings
from batchmlx.engine.host.threads import ThreadGovernor
from batchmlx.worker.media import MediaReader
from batchmlx.worker.translate import Translator

if TYPE_CHECKING:
    from batchmlx.engine.host.backend import HostBackend

log = logging.getLogger("batchmlx.worker")


@dataclass(slots=True)
class ServingModel:
    """One loaded model: the engine that runs it and the translator that feeds it."""

    name: str  # the model string the worker was asked for
    engine: EngineProtocol
    translator: Translator
    embedder: EmbedderProtocol | None = None  # /v1/embeddings; None: this engine has none
    threads: ThreadGovernor | None = None  # re-fits the BLAS threads to the load between steps


EngineFactory = Callable[[str], ServingModel]  # model name → a fresh engine for it


def mlx_engine_factory(
    *,
    cache_dir: Path,
    dtype: str,
    engine: EngineSettings,
    host: HostSettings | None = None,
    media: MediaSettings | None = None,
) -> EngineFactory:
    """The MLX engine, loaded on first use of each model (MLX is imported then, not here).
    `host`: the CPU backend's switches (config.py); one HostBackend serves every model.
    `media`: where a vision model's https and file images may come from (config.py)."""
    backends: list[HostBackend] = []

    def build(name: str) -> ServingModel:
        if not backends:
            from batchmlx.engine.host.backend import HostBackend, install

            backends.append(install(HostBackend(host)))
        return build_engine(name, cache_dir=cache_dir, dtype=dtype, settings=engine,
                            backend=backends[0], media=media)  # fmt: skip

    return build


def build_engine(
    name: str,
    *,
    cache_dir: Path,
    dtype: str = "auto",
    settings: EngineSettings,
    backend: HostBackend | None = None,
    media: MediaSettings | None = None,
) -> ServingModel:
    """Load the model `name` and wrap it in an Engine and the Translator that feeds it. The
    engine's thread count is set first (engine/host/threads.py), before anything computes.
    `backend`: the CPU backend the model computes with (default: the process's); its thread
    count is the one chosen here, which the governor then moves. `media`: where a vision
    model's images may come from (default: MediaSettings(): https from global addresses, no
    files)."""
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.choose import make_engine
    from batchmlx.engine.host.backend import current
    from batchmlx.engine.host.threads import apply_threads, choose_threads
    from batchmlx.engine.models.loader import collector_paused, load_model

    backend = backend or current()
    # the first look at the neighbours spans the model load (no wait of its own): all the
    # budget's CPUs until then, refitted as soon as the model is in. --threads wins over
    # BATCHMLX_THREADS (the CLI's flag reads it too; this is for callers without the CLI)
    requested = settings.threads if settings.threads is not None else backend.settings.threads
    threads = choose_threads(requested, measure=False)
    how = apply_threads(threads, backend.threads)
    governor = ThreadGovernor(threads, backend.threads)

    spec = resolve_model(name, cache_dir=cache_dir)
    if spec is None:
        raise ValueError(f"model {name!r} cannot be resolved")
    from batchmlx.engine.vision.load import is_vision_model

    if is_vision_model(spec.kind, spec.source):
        reader = MediaReader.from_settings(media or MediaSettings())
        serving = _vision_engine(name, spec.name, spec.source, settings, governor, reader)
        governor.review(now=True)
        return serving
    with collector_paused():
        loaded = load_model(spec, cache_dir=cache_dir, dtype=dtype, backend=backend)
        engine = make_engine(
            loaded.model, loaded.tokenizer, name=loaded.spec.name,
            context_length=loaded.context_length, config=settings,
        )  # fmt: skip
    assert engine.grammars is not None  # text runners take structured outputs
    translator = Translator(
        loaded.tokenizer, loaded.spec.name, engine.max_context_tokens, loaded.eos_token_ids,
        vocab_size=_vocab_size(loaded), grammar_check=engine.grammars.check,
    )  # fmt: skip
    try:
        embedder: EmbedderProtocol | None = engine.embedder
    except ValueError:  # a model layout with no hidden-state body to pool
        embedder = None
    governor.review(now=True)
    log.info("engine threads: %d (%s; %s)", governor.threads, threads.why, ", ".join(how))
    return ServingModel(name, engine, translator, embedder, governor)


def _vision_engine(
    name: str,
    model_name: str,
    source: str,
    settings: EngineSettings,
    governor: ThreadGovernor,
    media: MediaReader,
) -> ServingModel:
    """A vision-language model through mlx-vlm (engine/runners/vision.py): prompts
    prefilled one at a time, decodes batched (the engine logs which)."""
    from batchmlx.engine.runners.vision import vision_engine
    from batchmlx.engine.vision.load import load_vision
    from batchmlx.engine.vision.prompter import VisionPrompter

    model, processor, config = load_vision(source)
    text = config.get("text_config") or {}
    context = int(text.get("max_position_embeddings") or config.get("max_position_embeddings")
                  or 2048)  # fmt: skip
    engine = vision_engine(model, processor, context_length=context, config=settings)
    tok = engine.tokenizer
    eos = config.get("eos_token_id") or tok.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    vocab = text.get("vocab_size") or config.get("vocab_size")
    translator = Translator(
        tok, model_name, engine.max_context_tokens, eos_ids,
        vocab_size=int(vocab) if vocab else None, grammar_check=_no_grammar,
        vision=VisionPrompter(processor, config, model_name), media=media,
    )  # fmt: skip
    log.info("model %s: vision-language (mlx-vlm %s)", model_name, config.get("model_type"))
    return ServingModel(name, engine, translator, None, governor)


def _no_grammar(schema: str) -> str | None:
    del schema
    return "structured outputs are not supported on vision-language models yet"


def _vocab_size(loaded: Any) -> int | None:
    """Rows of the model's token embedding (prompt token ids must be below it)."""
    size = loaded.config.get("vocab_size") or getattr(
        getattr(loaded.model, "args", None), "vocab_size", None
    )
    return int(size) if size else None
