"""Packed steps on the host alone (engine/host/step.py): every step's logits against the MLX
path's on the same step (decodes straight from the paged pool, or with the paged kernel off
over the dense copy or gathered keys, prompt chunks alone,
padded together or beside decodes, behind a shared prefix), greedy tokens equal, the models it
declines; on the real default model, text equal to the MLX path's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

from batchmlx.config import HostSettings
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.engine.host import ops as host_ops
from batchmlx.engine.host import paged_attention
from batchmlx.engine.host.backend import current
from batchmlx.engine.host.linear import HostFormat, runs_here, to_host_format
from batchmlx.engine.host.step import HostRope, HostStep, backend_of, unsupported
from tests.engine.helpers import assert_greedy_texts_agree, host_formats, random_llama
from tests.engine.test_decode_kv import churn
from tests.engine.test_engine_tiny import engine, staggered

pytestmark = pytest.mark.skipif(not current().onednn_available(), reason="oneDNN (onednn-cpu-gomp)")
FORMATS = host_formats()
# the format every CPU runs (bf16 in oneDNN 3.2 needs AVX-512)
ANY = HostFormat.BF16 if runs_here(HostFormat.BF16) else HostFormat.F32
# bound on max |host - MLX| / max |MLX| of a step's logits: the same arithmetic in another
# order of float32 sums, whose last-bit differences move some GEMM inputs across a bf16
# rounding (or int8 quantization) step: one such flip moves a product by up to 2^-8 of an
# input (measured on these models, whose weights are scaled up: bf16 <= 1.1e-2 over the dense
# copy, 1.8e-2 from the paged kernel, whose other order of sums flips another rounding: its
# float32 steps are within 1e-5, as the others', int8 <= 1.7e-2)
# int8: the two paths' GEMM inputs differ in the last float32 bits (the order of sums in norms
# and RoPE), and one activation whose rounding to its group's 8 bits flips moves the product by
# a whole quantization step, which this tiny model's 4x weights amplify: measured up to 0.12 of
# the largest logit at groups of 32 (0.067 with one group per row). The argmax and the tokens
# below are held to equality.
TOLERANCE = {HostFormat.BF16: 3e-2, HostFormat.INT8: 0.2, HostFormat.F32: 1e-4}


def tiny(fmt: HostFormat, traditional: bool = False):
    return to_host_format(random_llama(rope_traditional=traditional), fmt)


class Compare:
    """Runs every host step twice, the MLX path first, and keeps the logits' difference."""

    def __init__(self, eng) -> None:
        self.runner = eng.runner.forward_pass
        self.host = eng.runner.forward_pass.host
        assert self.host is not None
        self.forward = eng.runner.forward_pass.forward
        self.diffs: list[float] = []
        self.argmax_equal = True
        self.rows = self.rows_equal = 0  # rows compared, rows with the same argmax
        eng.runner.forward_pass.forward = self

    def __call__(self, layout, rows):
        if not self.host.runs(layout):
            return self.forward(layout, rows)
        self.runner.host = None
        want = np.array(self.forward(layout, rows))  # writes the same KV rows the host rewrites
        self.runner.host = self.host
        got = np.array(self.forward(layout, rows))
        self.diffs.append(float(np.abs(got - want).max() / np.abs(want).max()))
        same = got.argmax(-1) == want.argmax(-1)
        self.argmax_equal &= bool(same.all())
        self.rows += same.size
        self.rows_equal += int(same.sum())
        return mx.array(got)


# how the host step's decode rows read their keys: straight from the pool (the paged kernel),
# or with it off (a CPU without AVX-512) through the dense copy or gathered
KV_PATHS = ["paged", "dense-copy", "gathered"]


def kv_path(monkeypatch, path: str) -> bool:
    """Sets the decode rows' path up; returns the engine's dense_decode."""
    if path != "paged":
        monkeypatch.setattr(paged_attention, "takes", lambda d, rep: False)
    elif paged_attention.library() is None:
        pytest.skip("the paged kernel does not run on this CPU")
    return path == "dense-copy"


def _tokens(outs) -> dict[str, list[int]]:
    return {k: o.token_ids for k, o in outs.items()}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", KV_PATHS)
def test_host_steps_match_the_mlx_path_with_sequences_joining_and_leaving(fmt, path, monkeypatch):
    dense = kv_path(monkeypatch, path)
    model = tiny(fmt)
    work = churn()  # arrivals while others decode: host steps and mixed MLX steps alternate
    e = engine(model, max_batch_size=8, max_prefill_tokens=24, block_size=8, dense_decode=dense)
    cmp = Compare(e)
    outs = staggered(e, work)
    assert len(cmp.diffs) == cmp.host.steps == e.runner.stats.steps >= 20  # every step, on the host
    assert e.runner.stats.mixed_steps > 0  # prompt chunks beside decodes
    if dense:
        assert e.runner.decode_kv.rebuilds >= 2 and e.runner.decode_kv.joins >= 2
    else:
        assert e.runner.decode_kv is None
    assert max(cmp.diffs) < TOLERANCE[fmt], max(cmp.diffs)
    if fmt is HostFormat.INT8:
        # a flipped 8-bit rounding (see TOLERANCE) can turn a near-tie of this tiny model, and
        # from there the text: the steps agree on nearly every argmax, not on all
        assert cmp.rows_equal >= 0.95 * cmp.rows, (cmp.rows_equal, cmp.rows)
        return
    assert cmp.argmax_equal
    # and the same tokens as an engine that never runs host steps
    monkey = engine(model, max_batch_size=8, max_prefill_tokens=24, block_size=8,
                    dense_decode=dense)  # fmt: skip
    monkey.runner.forward_pass.host = None
    assert _tokens(outs) == _tokens(staggered(monkey, work))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", KV_PATHS)
def test_steps_behind_a_shared_prefix_match_the_mlx_path(fmt, path, monkeypatch):
    dense = kv_path(monkeypatch, path)
    model = tiny(fmt, traditional=True)
    rng = np.random.default_rng(5)
    shared = rng.integers(1, 97, size=140).tolist()  # 17 blocks of 8: cascade attention
    params = SamplingParams(max_tokens=12, temperature=0.0)
    # four at once (chunks padded together behind the cached prefix), then one at a time
    work = [(at, GenerationRequest(f"p{i}", shared + rng.integers(1, 97, size=3 + i).tolist(),
                                   params))
            for i, at in enumerate((0, 0, 0, 0, 5, 9))]  # fmt: skip
    cfg = dict(max_batch_size=8, block_size=8, max_prefill_tokens=512, dense_decode=dense)
    e = engine(model, **cfg)
    cmp = Compare(e)
    got = staggered(e, work)
    if dense:
        assert e.runner.decode_kv.prefix_gathers >= 1  # the decodes read the prefix once, kept
    assert e.runner.scheduler.stats.prefix_hits + e.runner.scheduler.stats.hits >= 4
    assert max(cmp.diffs) < TOLERANCE[fmt]
    if fmt is HostFormat.INT8:  # a flipped 8-bit rounding turns near-ties (see the test above)
        assert cmp.rows_equal >= 0.95 * cmp.rows, (cmp.rows_equal, cmp.rows)
        return
    assert cmp.argmax_equal
    ref = engine(model, **cfg)
    ref.runner.forward_pass.host = None
    assert _tokens(got) == _tokens(staggered(ref, work))


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "numpy"])
@pytest.mark.parametrize(("traditional", "dims", "d"),
                         [(False, 16, 16), (True, 16, 16), (False, 8, 16), (True, 8, 16),
                          (False, 32, 32)],
                         ids=["halves", "pairs", "halves-partial", "pairs-partial",
                              "halves-vector"])  # fmt: skip
def test_host_rope_is_the_pair_formula_and_mlx_rope(monkeypatch, native, traditional, dims, d):
    """HostRope.rotate_scaled over q and k heads at once (a strided view of the GEMM's rows,
    as the step passes it), in our kernel and in numpy: nn.RoPE's pair formula at each row's
    own position, bit for bit, and nn.RoPE itself within float32 rounding of the angles; dims
    below head_dim as they were; the query heads then times the scale, bit for bit."""
    if native and not host_ops.available():
        pytest.skip("the host ops kernel does not run here")
    monkeypatch.setattr(host_ops, "available", lambda: native)
    t, heads, scaled, scale = 5, 4, 3, np.float32(0.125)
    rope = nn.RoPE(dims, traditional=traditional, base=10000.0)
    host = HostRope(dims, traditional, 10000.0, 1.0, d, heads)
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((t, heads * d + 7)).astype(np.float32)  # 7 more: v, say
    positions = np.array([0, 3, 17, 250, 4095])
    x = rows[:, : heads * d].reshape(t, heads, d)
    tables = host.tables(positions)
    assert (tables.cos is None) == native
    out = host.rotate_scaled(rows[:, : heads * d], tables, scaled, scale)
    got = out.copy()
    got[:, :scaled] /= scale  # exact: a power of two
    first, second = host._pairs()
    cos, sin = tables.half_cos[:, None, :], tables.half_sin[:, None, :]
    x1, x2 = x[..., first], x[..., second]
    np.testing.assert_array_equal(got[..., first], x1 * cos - x2 * sin)
    np.testing.assert_array_equal(got[..., second], x1 * sin + x2 * cos)
    np.testing.assert_array_equal(got[..., dims:], x[..., dims:])
    for i, p in enumerate(positions):
        row = mx.array(x[i].reshape(1, heads, 1, d))
        want = np.array(rope(row, offset=int(p))).reshape(heads, d)
        # the angle p * theta_i rounds to float32 in either: ~p * 2^-24 of it, times |x| <~ 4
        np.testing.assert_allclose(got[i], want, rtol=0, atol=1e-6 + 3e-7 * int(p))


def test_models_it_does_not_run_keep_the_mlx_path(monkeypatch):
    f32 = tiny(ANY)
    e = engine(f32)
    assert e.runner.forward_pass.host is not None
    mx.random.seed(0)
    plain = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=97, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True))  # fmt: skip
    plain.set_dtype(mx.float32)
    e = engine(plain)
    assert e.runner.forward_pass.host is None  # float32 weights: MLX's own GEMMs, exact to mlx-lm
    assert unsupported(plain, e.runner.storage) == "embedding not in a host format"
    # BATCHMLX_HOST_STEPS=0: the switch of the backend the model's host layers were built with
    monkeypatch.setattr(backend_of(f32), "settings", HostSettings(host_steps=False))
    assert HostStep.of(f32, engine(f32).runner.storage) is None
    e = engine(f32)
    assert e.runner.forward_pass.host is None


@pytest.mark.slow
def test_real_model_text_equals_the_mlx_path(default_model_bf16):
    # bf16: in int8 a float32 sum in another order can flip an input's rounding to 8 bits,
    # so the two paths part at more near-ties (test_host_families and test_invariance cover
    # int8's host step)
    lm = default_model_bf16
    qs = [f"Question {i}: tell me a fact about the number {i * 7 + 3}." for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2)
    reqs = [GenerationRequest(f"q{i}", lm.tokenizer.encode(q), params) for i, q in enumerate(qs)]

    def run(host: bool):
        from batchmlx.core.engine_api import EngineSettings
        from batchmlx.engine.runners.paged import paged_engine

        e = paged_engine(lm.model, lm.tokenizer, context_length=lm.context_length,
                   config=EngineSettings(max_batch_size=8, adaptive_width=False))  # fmt: skip
        if not host:
            e.runner.forward_pass.host = None
        cmp = Compare(e) if host else None
        return e.generate(reqs), cmp

    want, _ = run(False)
    got, cmp = run(True)
    assert cmp.host.steps >= 20
    assert max(cmp.diffs) < 5e-2, max(cmp.diffs)  # 30 layers: measured <= 1.8e-2
    # 7 of 8 equal with 64-query attention tiles, 6 with 16 (the sums' order moved: two texts
    # part at near-ties, max logit difference 0.013 either way)
    assert sum(g.token_ids == w.token_ids for g, w in zip(got, want, strict=True)) >= 6
    # where a text parts, the MLX path was at a near-tie (measured: 0.013 in logprob)
    assert_greedy_texts_agree(got, want)
