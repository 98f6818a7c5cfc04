"""A tiny random-weight llama saved as an MLX folder, with the default model's real tokenizer
(so chat templates work): loads and steps in milliseconds, for tests about durability."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 49152,  # the tokenizer's
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tokenizer_source(cache: Path) -> Path:
    return cache / "models" / "SmolLM2-135M-Instruct-mlx"


def build_tiny_model(dest: Path, cache: Path, config: dict | None = None) -> Path:
    """Write the folder `dest` (config.json, model.safetensors, tokenizer files). config: the
    model's config.json (default CONFIG, a llama); any mlx-lm model_type with the tokenizer's
    vocabulary."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    config = CONFIG if config is None else config
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")

    src = tokenizer_source(cache)
    if not all((src / f).is_file() for f in TOKENIZER_FILES):
        from batchmlx.core.models import resolve_model
        from batchmlx.engine.models.loader import model_folder

        model_folder(resolve_model("default", cache_dir=cache), cache_dir=cache)
    dest.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER_FILES:
        shutil.copyfile(src / f, dest / f)
    return dest
