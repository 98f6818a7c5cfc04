"""The dense (dequantized) copy of a converted model: written by the first load, read by the
next, rewritten when the source changes, never made for folders batchmlx did not convert."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from batchmlx.core.models import resolve_model
from batchmlx.engine.models import default_model as dm
from batchmlx.engine.models import dense
from batchmlx.engine.models.loader import load_model

pytestmark = pytest.mark.real_model


@pytest.fixture
def gguf_copy(engine_cache_dir: Path, default_model_dir: Path, tmp_path: Path):
    """The default GGUF copied, so its mtime can change without touching the shared cache.
    Its conversions (a 540 MB float32 copy each) are removed after the test, not kept with
    pytest's last temp folders."""
    src = tmp_path / "src" / "small.gguf"
    src.parent.mkdir()
    shutil.copyfile(dm.default_gguf_path(engine_cache_dir), src)
    yield src
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
    shutil.rmtree(tmp_path / "src", ignore_errors=True)


def _weights(loaded) -> dict[str, mx.array]:
    return dict(tree_flatten(loaded.model.parameters()))


def _same_weights(a, b) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(
        wa[k].dtype == wb[k].dtype and mx.array_equal(wa[k], wb[k]).item() for k in wa
    )


def _greedy(loaded, n: int = 12) -> list[int]:
    from mlx_lm.generate import generate_step

    prompt = mx.array(loaded.tokenizer.encode("The capital of France is"))
    return [int(t) for t, _ in generate_step(prompt, loaded.model, max_tokens=n)]


def test_a_gguf_conversion_needs_no_copy(gguf_copy: Path, tmp_path: Path) -> None:
    """GGUF tensors are dequantized to float32 as the file is converted (engine/models/gguf):
    the converted folder is the dense model, read as it is at every start, with no copy."""
    cache = tmp_path / "cache"
    spec = resolve_model(str(gguf_copy), cache_dir=cache)
    first = load_model(spec, cache_dir=cache, dtype="float32")
    assert "quantization" not in first.config
    assert not dense.dense_folder(first.path, "float32").exists()
    again = load_model(spec, cache_dir=cache)  # auto: the same folder, no copy written
    assert again.path == first.path
    assert not dense.dense_folder(first.path, "float32").exists()
    assert _greedy(first) == _greedy(load_model(spec, cache_dir=cache, dtype="float32"))


def test_local_mlx_folders_get_no_copy(default_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    shutil.copytree(default_model_dir, folder)
    spec = resolve_model(str(folder), cache_dir=tmp_path / "cache")
    assert spec.kind == "mlx_dir"
    loaded = load_model(spec, cache_dir=tmp_path / "cache", dtype="float32")
    assert loaded.path == folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    shutil.rmtree(folder)


def test_no_copy_over_the_size_bound_or_when_it_cannot_be_written(
    gguf_copy: Path, tmp_path: Path, monkeypatch
) -> None:
    cache = tmp_path / "cache"
    spec = resolve_model(str(gguf_copy), cache_dir=cache)
    monkeypatch.setattr(dense, "MAX_DENSE_BYTES", 1 << 20)
    loaded = load_model(spec, cache_dir=cache, dtype="float32")
    copy = dense.dense_folder(loaded.path, "float32")
    assert not copy.exists()
    monkeypatch.setattr(dense, "MAX_DENSE_BYTES", 1 << 40)

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dense.mx, "save_safetensors", full_disk)
    again = load_model(spec, cache_dir=cache, dtype="float32")  # still loads
    assert _same_weights(loaded, again)
    assert not copy.exists()
    assert not [p for p in copy.parent.iterdir() if ".tmp-" in p.name]
