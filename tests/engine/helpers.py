"""Shared references for the attention tests."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama

from batchmlx.engine.host import q8
from batchmlx.engine.host.linear import HostFormat, runs_here


def naive(q, k, v, scale, mask):
    """Reference in float64 numpy: softmax over the keys each query may see."""
    q, k, v, mask = (np.array(x).astype(np.float64) for x in (q, k, v, mask))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.where(mask.astype(bool), q @ k.swapaxes(-1, -2) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 in plain integer arithmetic (nearest, ties to even), as
    uint16 bits: a reference for OneDNN.to_bf16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = u + ((u >> np.uint32(16)) & np.uint32(1))
    r += np.uint32(0x7FFF)
    return (r >> np.uint32(16)).astype(np.uint16)


def where_it_runs(fmt: HostFormat) -> pytest.MarkDecorator:
    """Skips where this CPU has no matmul for `fmt` (oneDNN 3.2: bf16 needs AVX-512, exact
    int8 VNNI)."""
    return pytest.mark.skipif(not runs_here(fmt), reason=f"no {fmt.value} matmul on this CPU")


def host_formats(*, packed_only: bool = False) -> list:
    """The host weight formats as pytest params, each skipped where this CPU lacks it.
    packed_only: without float32, whose weights oneDNN does not pack."""
    # (q4 is int8 but for a 4-bit model's layers: tests/engine/test_q4.py runs it on one;
    # w8 is int8's and q4's head: tests/engine/test_head8.py)
    return [pytest.param(f, id=f.value, marks=where_it_runs(f)) for f in HostFormat
            if not (packed_only and f is HostFormat.F32)
            and f not in (HostFormat.Q4, HostFormat.W8)]  # fmt: skip


def assert_greedy_texts_agree(got: list, want: list, *, margin: float = 0.1) -> None:
    """Greedy outputs of two runs that differ only in the order of float32 sums (another batch
    width, another kernel): the same tokens, or, where a text parts from the other, a near-tie
    there, the one's token the other's runner-up within `margin` in logprob. Both runs must
    ask for logprobs with top_logprobs >= 2."""
    for g, w in zip(got, want, strict=True):
        i = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=False))
                  if a != b), None)  # fmt: skip
        if i is None:
            assert len(g.token_ids) == len(w.token_ids), (g.token_ids, w.token_ids)
            continue
        top = dict(w.logprobs[i].top)
        assert g.token_ids[i] in top, (w.request_id, i, top)
        assert top[w.token_ids[i]] - top[g.token_ids[i]] < margin, (w.request_id, i, top)


def grouped_exact(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The grouped int8 kernel's definition (engine/host/q8.py) in float64: per group, the
    exact integer product times the activation's and the weight's scales, in group order."""
    p, t = q8.quantize_groups(x)
    q, s = q8.quantize_groups(w)
    out = np.zeros((x.shape[0], w.shape[0]))
    for g in range(q8.groups(x.shape[1])):
        cut = slice(g * q8.GROUP, (g + 1) * q8.GROUP)
        part = p[:, cut].astype(np.int64) @ q[:, cut].T.astype(np.int64)
        out += part * (t[:, g : g + 1].astype(np.float64) * s[None, :, g].astype(np.float64))
    return out


def random_llama(**args: Any) -> llama.Model:
    """A 2-layer random-weight llama in float32 (seed 0; `args` override the tiny defaults),
    its weights scaled x4 so that the argmax is decided by the context, not by near-ties."""
    mx.random.seed(0)
    defaults = dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=97, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True,
    )  # fmt: skip
    m = llama.Model(llama.ModelArgs(**{**defaults, **args}))
    m.set_dtype(mx.float32)
    m.update(tree_map(lambda p: p * 4.0, m.parameters()))
    mx.eval(m.parameters())
    return m
