"""Every tensor type batchmlx reads from GGUF (core/gguf_support.TENSOR_TYPES): a llama file
whose matrices are stored in that type loads through the real loader, and each weight equals
gguf-py's own dequantization of the file; the conversion's peak memory is one tensor's, not
the model's."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from batchmlx.core.gguf_support import TENSOR_TYPES, scan_header, summary_of
from batchmlx.engine.models.gguf.affine import AFFINE
from batchmlx.engine.models.gguf.families import Placed, Transform
from batchmlx.engine.models.gguf.reader import open_gguf, summary
from batchmlx.engine.models.gguf.weights import write_safetensors
from tests.engine.test_gguf_families import greedy, load
from tests.gguf_files import CASES, hf_weights, random_model, write_gguf

Q = gguf.GGMLQuantizationType
# where each block keeps its float16 scales (d, and dmin/m), as gguf-py's dequantize reads them
_SCALES = {
    Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q2_K: (-4, -2), Q.Q3_K: (-2,), Q.Q6_K: (-2,),
}  # fmt: skip
# hidden 256: the K-quants' blocks are 256 values of a row
CONFIG = {**CASES["llama"].config, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def dequantized(params: dict, base: str, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """A quantized layer's weights as MLX dequantizes them, and each value's step (its scale)."""
    scales = params[f"{base}.scales"]
    w = mx.dequantize(params[f"{base}.weight"], scales, params[f"{base}.biases"], group_size=32,
                      bits=bits)  # fmt: skip
    return np.array(w), np.repeat(np.array(scales), 32, axis=1)


def random_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes of a `qtype` tensor of `shape`, its scales small finite float16s."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for at in _SCALES[qtype]:
        scale = rng.uniform(0.001, 0.01, n_blocks).astype(np.float16).view(np.uint8)
        raw[:, at : (at + 2) or None] = scale.reshape(n_blocks, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def stored_as(type_name: str, rng: np.random.Generator):
    qtype = Q[type_name]

    def quantize(name: str, value: np.ndarray):
        if value.ndim != 2:
            return None  # norms stay F32, as llama.cpp keeps them
        if qtype == Q.F16:
            return value.astype(np.float16), qtype
        if qtype == Q.BF16:
            return gguf.quants.quantize(value, qtype), qtype
        return random_blocks(qtype, value.shape, rng), qtype

    return quantize


@pytest.mark.parametrize("type_name", sorted(TENSOR_TYPES - {"F32"}))
def test_type_loads_as_gguf_py_dequantizes_it(type_name: str, tmp_path: Path) -> None:
    case = replace(CASES["llama"], config=CONFIG)
    weights = hf_weights(random_model(CONFIG))
    rng = np.random.default_rng(0)
    path = write_gguf(tmp_path / f"m.{type_name}.gguf", case, weights,
                      quantize=stored_as(type_name, rng))  # fmt: skip
    loaded = load(path, tmp_path / "cache")
    params = dict(tree_flatten(loaded.model.parameters()))
    reader = gguf.GGUFReader(str(path))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, CONFIG["num_hidden_layers"])
    kind = AFFINE.get(type_name)
    checked = 0
    for key in weights:
        base, _, suffix = key.rpartition(".")
        t = next(t for t in reader.tensors if t.name == f"{names.get_name(base)}.{suffix}")
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(weights[key].shape)
        if kind is not None and t.tensor_type.name == type_name:
            # kept in its bits: MLX's affine arrays, in memory as in the folder
            assert params[key].dtype == mx.uint32, key
            got, step = dequantized(params, base, kind.bits)
            if kind.exact:
                np.testing.assert_array_equal(got, want, err_msg=key)
            else:  # requantized (sub-blocks of 16): within half a step of gguf-py's values
                assert (np.abs(got - want) <= step * 0.5001).all(), key
        else:
            got = np.array(params[key].astype(mx.float32))
            np.testing.assert_array_equal(got, want, err_msg=key)
        checked += t.tensor_type.name == type_name
    assert checked == sum(w.ndim == 2 for w in weights.values())
    tokens, logits = greedy(loaded.model, [1, 2, 3], 2)
    assert np.isfinite(logits).all()
    # the submit-time scan of the header (no gguf-py reader) sees what the converter sees
    with open(path, "rb") as fh:
        scanned = summary_of(scan_header(fh), {int(t): t.name for t in Q})
    assert scanned == summary(open_gguf(path))
    assert scanned.tensor_types[type_name] == "token_embd.weight"


def test_unknown_type_is_refused_naming_it(tmp_path: Path) -> None:
    """IQ2_XXS (an i-quant gguf-py reads but batchmlx does not list) is refused by name."""
    from batchmlx.core.gguf_support import gguf_problem

    case = replace(CASES["llama"], config=CONFIG)
    weights = hf_weights(random_model(CONFIG))

    def iq(name: str, value: np.ndarray):
        if name != "blk.1.ffn_down.weight":
            return None
        block, size = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
        raw = np.zeros((value.shape[0], value.shape[1] // block * size), np.uint8)
        return raw, Q.IQ2_XXS

    path = write_gguf(tmp_path / "iq.gguf", case, weights, quantize=iq)
    problem = gguf_problem(summary(open_gguf(path)))
    assert problem is not None
    assert problem.startswith("its tensor type IQ2_XXS ('blk.1.ffn_down.weight') is not one")


@pytest.mark.parametrize("suffix", ["", ".weight"])
def test_conversion_memory_is_one_tensor_not_the_model(suffix: str, tmp_path: Path) -> None:
    """Eight Q8_0 tensors of 8M values (32 MB each as float32), written as floats or (a layer's
    `.weight`) in their bits: the peak of Python/numpy allocations while writing is under one
    tensor's float32 size (the model's is eight): the rows go out in slices."""
    rows, cols, count = 4096, 2048, 8
    w = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "llama")
    rng = np.random.default_rng(1)
    for i in range(count):
        w.add_tensor(f"t{i}", random_blocks(Q.Q8_0, (rows, cols), rng), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = open_gguf(tmp_path / "big.gguf")
    placed = [Placed(f"t{i}", f"t{i}{suffix}", Transform.NONE) for i in range(count)]
    tracemalloc.start()
    write_safetensors(f, placed, (1, 1), tmp_path / "out.safetensors")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    one = rows * cols * 4
    assert peak < one / 2, f"peak {peak / one:.2f} tensors"
    out = mx.load(str(tmp_path / "out.safetensors"))
    want = gguf.quants.dequantize(f.tensors["t7"].raw, Q.Q8_0)
    got = (
        out["t7"]
        if not suffix
        else mx.dequantize(
            out["t7.weight"], out["t7.scales"], out["t7.biases"], group_size=32, bits=8
        )
    )
    np.testing.assert_array_equal(np.array(got), want)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
def test_stacked_experts_load_as_gguf_py_dequantizes_them(type_name: str, tmp_path: Path) -> None:
    """A mixture of experts' file (qwen3moe) whose router and stacked experts [E, rows, cols]
    are quantized: the experts keep their bits (mlx-lm's QuantizedSwitchLinear), and each
    expert's weights dequantize to gguf-py's values."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    case = CASES["qwen3moe"]
    config = {**case.config, "hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64}
    weights = hf_weights(random_model(config))
    rng = np.random.default_rng(1)
    qtype = Q[type_name]

    def quantize(name: str, value: np.ndarray):
        return None if value.ndim == 1 else (random_blocks(qtype, value.shape, rng), qtype)

    path = write_gguf(tmp_path / "moe.gguf", replace(case, config=config), weights,
                      quantize=quantize)  # fmt: skip
    model = load(path, tmp_path / "cache").model
    params = dict(tree_flatten(model.parameters()))
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    bits = AFFINE[type_name].bits
    for layer in range(config["num_hidden_layers"]):
        for ours, theirs in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                             ("down_proj", "ffn_down_exps")):  # fmt: skip
            t = reader[f"blk.{layer}.{theirs}.weight"]
            assert t.tensor_type == qtype and len(t.shape) == 3
            assert isinstance(model.model.layers[layer].mlp.switch_mlp[ours], QuantizedSwitchLinear)
            base = f"model.layers.{layer}.mlp.switch_mlp.{ours}"
            want = gguf.quants.dequantize(t.data, t.tensor_type)
            for e in range(config["num_experts"]):
                got = mx.dequantize(
                    params[f"{base}.weight"][e],
                    params[f"{base}.scales"][e],
                    params[f"{base}.biases"][e],
                    group_size=32,
                    bits=bits,
                )
                np.testing.assert_array_equal(np.array(got), want[e])


def _q8_0(name: str, value: np.ndarray):
    """Matrices as llama.cpp's Q8_0 quantizer writes them (gguf-py's copy of it, bit-exact)."""
    return None if value.ndim != 2 else (gguf.quants.quantize(value, Q.Q8_0), Q.Q8_0)


@pytest.mark.parametrize("family", sorted(CASES))
def test_every_family_runs_in_its_bits(family: str, tmp_path: Path) -> None:
    """A Q8_0 file of each family loads as QuantizedLinear/QuantizedEmbedding (mlx-lm's own
    classes, 8 bits over 32), and its greedy tokens are mlx-lm's on gguf-py's dequantized
    weights (each family's sanitize and layout take the quantized arrays)."""
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    case = CASES[family]
    reference = random_model(case.config)
    weights = hf_weights(reference)
    path = write_gguf(tmp_path / f"{family}.gguf", case, weights, quantize=_q8_0)
    loaded = load(path, tmp_path / "cache")
    kinds = {type(m) for _, m in loaded.model.named_modules()}
    assert nn.QuantizedLinear in kinds and nn.Linear not in kinds
    # the same rows quantized: llama.cpp's q/k permutation only moves whole rows
    dequantized = {k: gguf.quants.dequantize(gguf.quants.quantize(v, Q.Q8_0), Q.Q8_0)
                   if v.ndim == 2 else v for k, v in weights.items()}  # fmt: skip
    reference.update(tree_unflatten([(k, mx.array(v)) for k, v in dequantized.items()]))
    want, want_logits = greedy(reference, [1, 2, 3, 4, 5], 4)
    got, got_logits = greedy(loaded.model, [1, 2, 3, 4, 5], 4)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert got == want


def test_int8_from_q8_0_is_the_files_own_ints_and_scales(tmp_path: Path) -> None:
    """--dtype int8 packs a Q8_0 layer (dequantized as it is packed) into the grouped kernel's
    format, int8 over 32 values with one float32 scale: the file's own q and d come back
    (llama.cpp's quantizer puts +-127 in every group, so max|w| / 127 is d exactly)."""
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.host import q8
    from batchmlx.engine.host.linear import HostLinear
    from batchmlx.engine.models.loader import load_model

    if not q8.available():
        pytest.skip("the grouped int8 kernel does not run on this CPU")
    case = replace(CASES["llama"], config=CONFIG)
    path = write_gguf(tmp_path / "q8.gguf", case, hf_weights(random_model(CONFIG)), _q8_0)
    spec = resolve_model(str(path), cache_dir=tmp_path / "cache")
    loaded = load_model(spec, cache_dir=tmp_path / "cache", dtype="int8")
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    layer = loaded.model.model.layers[1]
    checked = 0
    for module, names in ((layer.mlp.gate_proj, ("ffn_gate", "ffn_up")),
                          (layer.mlp.down_proj, ("ffn_down",))):  # fmt: skip
        assert isinstance(module, HostLinear)
        w = module._gemm._q8
        blocks = np.concatenate([np.asarray(reader[f"blk.1.{n}.weight"].data).reshape(-1, 34)
                                 for n in names])  # fmt: skip
        d = blocks[:, :2].view(np.float16).astype(np.float32).reshape(w.n, -1)
        q = blocks[:, 2:].view(np.int8).reshape(w.n, w.k)
        packed = w.packed.reshape(w.n // 16, w.k // 4, 16, 4).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(packed.reshape(w.n, w.k), q)
        ng = w.k // 32  # scales [N/16][ng][16] (q8.py)
        scales = w.scales.reshape(w.n // 16, ng, 16).transpose(0, 2, 1).reshape(w.n, ng)
        np.testing.assert_array_equal(scales, d)
        checked += 1
    assert checked == 2


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_quantized_experts_run_on_the_host_from_their_bits(dtype: str, tmp_path: Path) -> None:
    """A Q4_0 mixture of experts (qwen3moe) loaded in a host format: its experts are packed
    from the folder's 4-bit arrays (each expert dequantized in numpy, one at a time) and the
    engine's greedy tokens are mlx-lm's on the same file's QuantizedSwitchLinear layers."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.core.models import resolve_model
    from batchmlx.core.request import GenerationRequest, SamplingParams
    from batchmlx.engine.choose import make_engine
    from batchmlx.engine.host.linear import HostExperts
    from batchmlx.engine.models.loader import load_model

    case = CASES["qwen3moe"]
    config = {**case.config, "hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64}
    weights = hf_weights(random_model(config))

    def quantize(name: str, value: np.ndarray):
        if value.ndim != 3:
            return None
        return gguf.quants.quantize(value, Q.Q4_0), Q.Q4_0

    path = write_gguf(tmp_path / "moe.gguf", replace(case, config=config), weights, quantize)
    reference = load(path, tmp_path / "cache").model  # the folder as mlx-lm builds it
    assert isinstance(reference.model.layers[0].mlp.switch_mlp.up_proj, QuantizedSwitchLinear)
    spec = resolve_model(str(path), cache_dir=tmp_path / "cache")
    loaded = load_model(spec, cache_dir=tmp_path / "cache", dtype=dtype)
    kinds = {type(m) for _, m in loaded.model.named_modules()}
    if HostExperts not in kinds:
        pytest.skip("no host format for mixtures of experts on this CPU")
    prompts = [[5, 200, 17, 99, 3, 256, 41, 7], [9, 8, 7, 6, 5]]
    want = [[int(t) for t, _ in generate_step(mx.array(p), reference, max_tokens=4)]
            for p in prompts]  # fmt: skip
    settings = EngineSettings(block_size=4, cache_memory_mb=16, max_prefill_tokens=64,
                              max_batch_size=4)  # fmt: skip
    eng = make_engine(loaded.model, None, name="moe", context_length=256, config=settings)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outs = eng.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outs] == want


def test_a_model_too_large_to_pack_keeps_its_bits_or_is_refused(tmp_path: Path, monkeypatch,
                                                                caplog) -> None:  # fmt: skip
    """Packing for the host must fit the memory available: "auto" then keeps the file's bits
    on MLX's kernels, with a warning naming the sizes; a format asked for by name is refused
    with the same sizes, before anything is packed."""
    import logging

    from batchmlx.core.models import resolve_model
    from batchmlx.engine.host.linear import HostFormat, HostLinear
    from batchmlx.engine.kv import budget
    from batchmlx.engine.models import loader

    case = replace(CASES["llama"], config=CONFIG)
    path = write_gguf(tmp_path / "q8.gguf", case, hf_weights(random_model(CONFIG)), _q8_0)
    spec = resolve_model(str(path), cache_dir=tmp_path / "cache")
    stored = loader.load_model(spec, cache_dir=tmp_path / "cache", dtype="stored").model
    from batchmlx.engine.host import head8

    weights = hf_weights(random_model(CONFIG))
    values = sum(w.size for k, w in weights.items() if w.ndim == 2)
    # the embedding and the head (one table where tied) at the 8-bit head's 1.125 bytes
    head = sum(w.size for k, w in weights.items() if k.endswith(("embed_tokens.weight",
                                                                  "lm_head.weight")))  # fmt: skip
    rate = 1.125 if head8.available() else 2.0
    assert loader.packed_bytes(stored, HostFormat.INT8) == int((values - head) * 1.25
                                                               + head * rate)  # fmt: skip
    assert loader.packed_bytes(stored, HostFormat.BF16) == values * 2

    monkeypatch.setattr(budget, "available_memory_bytes", lambda on_gpu=None: values)
    with caplog.at_level(logging.WARNING, logger="batchmlx.engine"):
        auto = loader.load_model(spec, cache_dir=tmp_path / "cache", dtype="auto").model
    kinds = {type(m) for _, m in auto.named_modules()}
    assert HostLinear not in kinds and nn.QuantizedLinear in kinds
    assert "running it on MLX's kernels" in caplog.text
    with pytest.raises(loader.ModelTooLarge, match="--dtype stored"):
        loader.load_model(spec, cache_dir=tmp_path / "cache", dtype="bfloat16")
