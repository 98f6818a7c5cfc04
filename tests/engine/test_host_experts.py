"""engine/host/experts.py on its own, in numpy: routing as mlx-lm's qwen3_moe computes it, each
token's experts' outputs against a per-token reference, and the grouping of experts' runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from batchmlx.engine.host import experts as host_experts

D, INNER, E = 16, 8, 6


def _gemm(w: np.ndarray):
    def run(rows: np.ndarray, out: np.ndarray) -> None:
        out[...] = rows @ w.T

    return run


def _silu_glu(h: np.ndarray) -> np.ndarray:
    g, u = h[:, :INNER], h[:, INNER:]
    return g / (1 + np.exp(-g)) * u


def test_routing_is_mlx_lms():
    """softmax (float32), the top k, renormalized or not: mlx-lm's own ops on the same logits."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((40, E)).astype(np.float32) * 3
    for norm in (True, False):
        got = host_experts.route(logits.copy(), 2, norm)
        gates = mx.softmax(mx.array(logits), axis=-1, precise=True)
        inds = mx.argpartition(gates, kth=-2, axis=-1)[..., -2:]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if norm:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        order = np.argsort(np.array(inds), axis=1)  # ours ascending by expert
        want_e = np.take_along_axis(np.array(inds), order, axis=1)
        want_w = np.take_along_axis(np.array(scores), order, axis=1)
        assert (got.experts == want_e).all()
        np.testing.assert_allclose(got.weights, want_w, rtol=1e-6)
        assert (np.diff(got.experts, axis=1) > 0).all()


def test_each_tokens_experts_outputs_and_their_sum():
    """Tokens in any slot order, experts with no token, one expert past a group's rows: each
    (token, slot) is its expert's MLP of the token's row, and the sum is weighted per token."""
    rng = np.random.default_rng(1)
    up = [rng.standard_normal((2 * INNER, D)).astype(np.float32) for _ in range(E)]
    down = [rng.standard_normal((D, INNER)).astype(np.float32) for _ in range(E)]
    gemms = host_experts.ExpertGemms([_gemm(w) for w in up], [_gemm(w) for w in down],
                                     2 * INNER)  # fmt: skip
    t = 300
    x = rng.standard_normal((t, D)).astype(np.float32)
    chosen = np.stack([np.full(t, 4), rng.choice([0, 1, 3], t)], axis=1)  # 2, 5 get none
    chosen[::2] = chosen[::2, ::-1]
    out = host_experts.expert_outputs(x, chosen, gemms, _silu_glu)
    for i in range(t):
        for j in range(2):
            e = chosen[i, j]
            want = down[e] @ _silu_glu((up[e] @ x[i])[None])[0]
            np.testing.assert_allclose(out[i, j], want, rtol=2e-5, atol=2e-5)
    w = rng.random((t, 2)).astype(np.float32)
    y = host_experts.combine(out, w)
    np.testing.assert_allclose(y, out[:, 0] * w[:, :1] + out[:, 1] * w[:, 1:], rtol=1e-6)


def test_runs_are_grouped_up_to_group_rows():
    assert host_experts.GROUP_ROWS == 256
    got = host_experts._groups([0, 300, 5, 5, 250, 0, 1])
    assert got == [[(1, 0, 300)], [(2, 300, 305), (3, 305, 310)], [(4, 310, 560), (6, 560, 561)]]
    assert host_experts._groups([0, 0]) == []
