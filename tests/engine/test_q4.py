"""The grouped 4-bit kernel (engine/host/q4.py, native/q4.c) and the `q4` host format: the
product of its operands against float64, a row's result the same whatever the batch, its place,
the thread split or the path (VNNI, AMX); a 4-bit GGUF's layers kept in the file's own values;
host steps of a tiny random 4-bit llama against the MLX path."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from batchmlx.core.models import resolve_model
from batchmlx.engine.host import head8, q4, q8, quantized
from batchmlx.engine.host import weights_cache as host_cache
from batchmlx.engine.host.backend import current
from batchmlx.engine.host.linear import HostFormat, HostLinear, runs_here, to_host_format
from batchmlx.engine.models.loader import load_model, packed_bytes
from tests.engine.helpers import random_llama
from tests.engine.test_engine_tiny import engine, staggered
from tests.engine.test_gguf_types import CONFIG, stored_as
from tests.engine.test_host_step import Compare, churn
from tests.gguf_files import CASES, hf_weights, random_model, write_gguf

needs_kernel = pytest.mark.skipif(not runs_here(HostFormat.Q4), reason="no AVX-512 VNNI here")
AMX = [False, True] if q4.available() and q4.amx() else [False]


def _affine(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random 4-bit values, scales and biases (a Q4_1-like layer)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    s = rng.uniform(0.001, 0.02, (n, k // 32)).astype(np.float32)
    b = (-8 * s + rng.normal(0, 0.01, s.shape)).astype(np.float32)
    return q, s, b


def _run(x: np.ndarray, w: q4.Q4Weights, threads: int = 1, amx=None) -> np.ndarray:
    out = np.full((x.shape[0], w.n), np.nan, np.float32)
    q4.matmul(x, w, out, threads=threads, use_amx=amx)
    return out


def _rows(m: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("amx", AMX, ids=lambda a: "amx" if a else "vnni")
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 16, 32), (7, 80, 96), (13, 144, 576), (21, 64, 1536)]
)
def test_the_product_against_float64(m: int, n: int, k: int, amx: bool) -> None:
    q, s, b = _affine(n, k, 1)
    w = q4.Q4Weights.pack(q, s, b)
    x = _rows(m, k, 2)
    got = _run(x, w, amx=amx)
    # the definition in float64: activations quantized as q8's, weights s * q + b exactly
    xq, xs = q8.quantize_groups(x)
    w64 = (q.reshape(n, -1, 32) * s[:, :, None].astype(np.float64) + b[:, :, None]).reshape(n, k)
    x64 = (xq.reshape(m, -1, 32) * xs[:, :, None].astype(np.float64)).reshape(m, k)
    exact = x64 @ w64.T
    # float32 epilogue, one group at a time: within a few float32 roundings of the largest
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-6 * np.abs(exact).max())
    # and int8 activations' own error against the float product: Q8_0-like, ~0.5%
    ref = x.astype(np.float64) @ w64.T
    assert np.abs(got - ref).max() / np.abs(ref).max() < 0.02


@needs_kernel
def test_activations_quantized_as_q8_with_their_sums() -> None:
    x = _rows(21, 160, 4)
    x[2, 64:128] = 0.0  # an all-zero group: scale 1
    xq, xs, xsum = q4.quantize(x)
    q, s = q8.quantize_groups(x)
    assert np.array_equal(xq, q) and np.array_equal(xs, s)
    assert np.array_equal(xsum, q.reshape(21, 5, 32).sum(axis=2))
    # AMX's tiles: [16 rows][32] per (row tile, group), scales and sums [16] per one
    tq, ts, tsum = q4.quantize(x, tiles=True)
    assert np.array_equal(tq.reshape(2, 5, 16, 32).transpose(0, 2, 1, 3).reshape(32, 160)[:21], q)
    for part, want in ((ts, s), (tsum, xsum)):
        assert np.array_equal(part.reshape(2, 5, 16).transpose(0, 2, 1).reshape(32, 5)[:21], want)


@needs_kernel
def test_a_row_is_the_same_alone_in_any_batch_at_any_place_split_and_path() -> None:
    k, n = 576, 960
    w = q4.Q4Weights.pack(*_affine(n, k, 5))
    rows = _rows(70, k, 6)
    alone = np.stack([_run(rows[i : i + 1], w, amx=False)[0] for i in range(len(rows))])
    # VNNI's row blocks of 6 and their tails; AMX's tiles of 16 and their tails
    for m in (2, 5, 6, 7, 13, 16, 17, 33, 64, 70):
        for threads in (1, 2, 4):
            for amx in AMX:
                got = _run(rows[:m], w, threads, amx)
                assert np.array_equal(got, alone[:m]), (m, threads, amx)
    shuffled = np.random.default_rng(7).permutation(70)
    assert np.array_equal(_run(rows[shuffled], w, 2), alone[shuffled])
    wide = np.zeros((70, k + 32), np.float32)  # rows read through a wider array
    wide[:, 16 : 16 + k] = rows
    assert np.array_equal(_run(wide[:, 16 : 16 + k], w), alone)


@needs_kernel
@pytest.mark.parametrize("amx", AMX, ids=lambda a: "amx" if a else "vnni")
def test_the_pool_gives_one_threads_bits_for_any_shape_and_rows(amx: bool, monkeypatch) -> None:
    # every GEMM split, however small: q4.c's pool (native/pool.h) hands columns out in chunks
    # from a shared counter, which changes who computes a column, never its bits
    monkeypatch.setattr(q4, "SPLIT_MACS", 0)
    rng = np.random.default_rng(16)
    helped = q4.pool_workers()[1]
    for case in range(10):
        n, k = 16 * int(rng.integers(1, 80)), 32 * int(rng.integers(1, 40))
        m = int(rng.integers(8 if amx else 1, 200)) if case else 1
        w = q4.Q4Weights.pack(*_affine(n, k, 100 + case))
        x = _rows(m, k, 200 + case)
        one = _run(x, w, 1, amx)
        for threads in (2, 3, 4):
            got = _run(x, w, threads, amx)
            assert np.array_equal(got.view(np.uint32), one.view(np.uint32)), (n, k, m, threads)
    # the pool's threads took part: on a busy machine a worker may get no CPU before the
    # caller has taken every column of a small GEMM, so a longer one (~1 ms), until it does
    w = q4.Q4Weights.pack(*_affine(3072, 1536, 17))
    x = _rows(64, 1536, 18)
    one = _run(x, w, 1, amx)
    for _ in range(200):
        assert np.array_equal(_run(x, w, 2, amx), one)
        if q4.pool_workers()[1] > helped:
            break
    workers, now = q4.pool_workers()
    assert workers >= 3 and now > helped


_ONE_ROW = """
import numpy as np
from batchmlx.engine.host import q4
rng = np.random.default_rng(18)
w = q4.Q4Weights.pack(rng.integers(0, 16, (3072, 576), dtype=np.uint8),
                      *rng.uniform(0.001, 0.02, (2, 3072, 18)).astype(np.float32))
x = rng.standard_normal((1, 576)).astype(np.float32)
one, two = np.empty((1, 3072), np.float32), np.empty((1, 3072), np.float32)
q4.matmul(x, w, one, threads=1)
alone = q4.pool_workers()[0]
q4.matmul(x, w, two, threads=2)
print(alone, q4.pool_workers()[0], np.array_equal(one, two))
"""


@needs_kernel
def test_a_one_row_decode_gemm_splits_over_the_pool() -> None:
    # at the default threshold, one row of the 135M's gate-up (1 x 3,072 x 576), which the
    # Python thread pool left to one thread, goes to the pool (whose worker then takes what
    # columns the OS lets it: none on a busy machine, so its start is what tells; run in a
    # child, where no earlier test has started it)
    done = subprocess.run([sys.executable, "-c", _ONE_ROW], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.split() == [b"0", b"1", b"True"]


@needs_kernel
def test_q4_and_q8_pools_serve_calls_from_several_threads_at_once(monkeypatch) -> None:
    # each library has a pool of its own; one caller at a time uses each, the others compute
    # alone: the same bits either way
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(q4, "SPLIT_MACS", 0)
    monkeypatch.setattr(q8, "SPLIT_MACS", 0)
    w4 = q4.Q4Weights.pack(*_affine(1024, 576, 20))
    w8 = q8.Q8Weights.pack(_rows(1024, 576, 21) * 0.05)

    def both(x: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray]:
        out = np.empty((x.shape[0], 1024), np.float32)
        q8.matmul(x, w8, out, threads=threads)
        return _run(x, w4, threads), out

    xs = [_rows(m, 576, 300 + m) for m in (1, 5, 17, 64)]
    want = [both(x, 1) for x in xs]
    with ThreadPoolExecutor(4) as callers:
        for _ in range(10):
            got = list(callers.map(lambda x: both(x, 2), xs))
            for (g4, g8), (e4, e8) in zip(got, want, strict=True):
                assert np.array_equal(g4, e4) and np.array_equal(g8, e8)


@needs_kernel
@pytest.mark.parametrize("amx", AMX, ids=lambda a: "amx" if a else "vnni")
def test_a_row_holding_nan_shows_it_and_leaves_the_others_alone(amx: bool) -> None:
    w = q4.Q4Weights.pack(*_affine(32, 128, 8))
    x = _rows(5, 128, 9)
    clean = _run(x, w, amx=amx)
    x[2, 70] = np.nan
    got = _run(x, w, amx=amx)
    assert np.isnan(got[2]).all()
    assert np.array_equal(np.delete(got, 2, axis=0), np.delete(clean, 2, axis=0))


@needs_kernel
def test_mlx_affine_layers_packed_keep_their_values_and_adopt_back() -> None:
    parts = [_affine(48, 96, 10), _affine(16, 96, 11)]  # two layers fused along N
    mlx_parts = [(quantized.pack(q, 4), s, b) for q, s, b in parts]
    w = q4.Q4Weights.from_affine(mlx_parts)
    q, s, b = w.values()
    assert np.array_equal(q, np.concatenate([p[0] for p in parts]))
    assert np.array_equal(s, np.concatenate([p[1] for p in parts]))
    assert np.array_equal(b, np.concatenate([p[2] for p in parts]))
    again = q4.Q4Weights.adopt(w.buffer.copy(), 64, 96)
    assert again is not None and q4.Q4Weights.adopt(w.buffer[:-4], 64, 96) is None
    x = _rows(3, 96, 12)
    assert np.array_equal(_run(x, w), _run(x, again))


def tiny_4bit() -> nn.Module:
    """The tiny random llama with its linear layers 4-bit affine, groups of 32, float32 scales
    (as a converted 4-bit GGUF holds them); the tied embedding 8-bit."""
    model = random_llama()
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    nn.quantize(model, group_size=32, bits=8)
    mx.eval(model.parameters())
    return model


@needs_kernel
@pytest.mark.skipif(not current().onednn_available(), reason="oneDNN (onednn-cpu-gomp)")
def test_host_steps_of_a_4bit_model_match_the_mlx_path() -> None:
    model = to_host_format(tiny_4bit(), HostFormat.Q4)
    layers = model.model.layers[0]
    for layer in (layers.self_attn.q_proj, layers.self_attn.o_proj, layers.mlp.down_proj):
        assert isinstance(layer, HostLinear) and layer._gemm.fmt is HostFormat.Q4
    e = engine(model, max_batch_size=8, max_prefill_tokens=24, block_size=8)
    cmp = Compare(e)
    work = churn()
    outs = staggered(e, work)
    assert len(cmp.diffs) == cmp.host.steps == e.runner.stats.steps >= 20
    # the same GEMMs on both paths; their inputs differ in the last float32 bits (norms, RoPE
    # in another order), which can flip an activation's 8-bit rounding (test_host_step's int8)
    assert max(cmp.diffs) < 0.2, max(cmp.diffs)
    assert cmp.rows_equal >= 0.95 * cmp.rows, (cmp.rows_equal, cmp.rows)
    # and greedy text: a host-step engine's against one that never runs host steps
    ref = engine(model, max_batch_size=8, max_prefill_tokens=24, block_size=8)
    ref.runner.forward_pass.host = None
    same = sum(o.token_ids == staggered(ref, work)[rid].token_ids for rid, o in outs.items())
    assert same >= 0.8 * len(outs), (same, len(outs))


def test_the_memory_check_counts_kept_4bit_layers_at_six_bits() -> None:
    model = tiny_4bit()  # linear layers 4-bit, the embedding 8-bit
    linear = sum(
        m.weight.size * 8 for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)
    )
    int8 = packed_bytes(model, HostFormat.INT8)
    # the embedding: int8's 8-bit head where it runs (1.125 bytes a value), q4's bf16 (2)
    emb = model.model.embed_tokens.weight.size * 4
    head = int(emb * (2.0 - 1.125)) if head8.available() else 0
    assert packed_bytes(model, HostFormat.Q4) == int8 - int(linear * 0.5) + head  # 1.25 -> 0.75


@needs_kernel
def test_layers_not_4bit_are_int8s() -> None:
    """A float model asked for q4: every linear layer int8's (nothing 4-bit to keep)."""
    model = to_host_format(random_llama(), HostFormat.Q4)
    gemms = {m._gemm for _, m in model.named_modules() if isinstance(m, HostLinear)}
    assert gemms and all(g.fmt is HostFormat.INT8 and g._q4 is None for g in gemms)


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_a_4bit_gguf_keeps_the_files_values(type_name: str, tmp_path: Path) -> None:
    case = replace(CASES["llama"], config=CONFIG)
    weights = hf_weights(random_model(CONFIG))
    path = write_gguf(tmp_path / f"m.{type_name}.gguf", case, weights,
                      quantize=stored_as(type_name, np.random.default_rng(0)))  # fmt: skip
    spec = resolve_model(str(path), cache_dir=tmp_path / "cache")
    loaded = load_model(spec, cache_dir=tmp_path / "cache", dtype="q4")
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    want = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(
        CONFIG["hidden_size"], -1
    )
    gemm = loaded.model.model.layers[0].mlp.down_proj._gemm
    assert gemm.fmt is HostFormat.Q4 and gemm._q4 is not None
    q, s, b = gemm._q4.values()
    # s * q + b, one product and one sum in float32: gguf-py's values bit for bit
    got = (q.reshape(q.shape[0], -1, 32) * s[:, :, None] + b[:, :, None]).reshape(q.shape)
    np.testing.assert_array_equal(got, want)
    ids = mx.array([[1, 2, 3, 4]])
    logits = np.array(loaded.model(ids)[0, -1])
    # a second start reads the packed layers back from the host weights cache: the same bytes
    assert host_cache.wait_written(60)  # (written behind the first start, in a thread)
    again = load_model(spec, cache_dir=tmp_path / "cache", dtype="q4")
    cached = again.model.model.layers[0].mlp.down_proj._gemm
    # the mapped file's read-only bytes, not packed anew
    assert isinstance(cached.packed, np.ndarray) and not cached.packed.flags.writeable
    assert np.array_equal(cached._q4.buffer, gemm._q4.buffer)
    assert np.array_equal(np.array(again.model(ids)[0, -1]), logits)
    stored = load_model(spec, cache_dir=tmp_path / "cache", dtype="float32")
    ref = np.array(stored.model(ids)[0, -1])
    # int8 activations on the file's own weights: close to float32 on the same weights
    assert np.abs(logits - ref).max() < 0.05 * np.abs(ref).max()


@needs_kernel
def test_4bit_experts_keep_their_bits() -> None:
    """An mlx-lm 4-bit qwen3_moe (QuantizedSwitchLinear experts, float32 scales): in q4 each
    expert's GEMMs hold its own 4-bit values, and the host step's logits are the quantized
    model's within int8 activations' error."""
    import copy

    from batchmlx.engine.host.linear import HostExperts
    from tests.engine.test_host_families import (
        PACKED_TOLERANCE,
        SPECS,
        build,
        host_logits,
        prompts,
        reference,
    )

    ref = build(next(s for s in SPECS if s.name == "qwen3_moe"), host=False)
    nn.quantize(ref, group_size=32, bits=4)
    host = to_host_format(copy.deepcopy(ref), HostFormat.Q4)
    experts = host.model.layers[0].mlp.switch_mlp
    assert isinstance(experts, HostExperts)
    assert all(g._gemm._q4 is not None for g in [*experts.gate_up, *experts.down])
    ps = prompts()
    refs = [reference(ref, p, 4) for p in ps]
    for step, logits in enumerate(host_logits(host, ps, [toks for _, toks in refs])):
        want = np.stack([r[0][step] for r in refs])
        diff = float(np.abs(logits - want).max() / np.abs(want).max())
        assert diff < PACKED_TOLERANCE[HostFormat.INT8], (step, diff)
