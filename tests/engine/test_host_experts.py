"""engine/host/experts.py on its own, in numpy: routing as mlx-lm's qwen3_moe computes it, each
token's experts' outputs against a per-token reference, and the grouping of experts' runs; and
int8's experts (HostExperts) a group of runs in one kernel call, with one call an expert's bits."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from batchmlx.engine.host import experts as host_experts
from batchmlx.engine.host.backend import current
from batchmlx.engine.host.elementwise import swiglu_halves
from batchmlx.engine.host.linear import HostExperts, HostFormat, runs_here

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


@pytest.mark.skipif(not runs_here(HostFormat.INT8), reason="no int8 kernel here")
def test_int8_experts_run_a_group_of_experts_in_one_call_with_their_bits():
    """A SwitchGLU in int8: each group of consecutive experts' runs (one past GROUP_ROWS rows
    alone) goes to the kernel in one gate-up call and one down call (q8.c's q8_experts), and
    every (token, slot) gets the bits of one call an expert. In bf16, one call an expert."""
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(3)
    be = current()
    host = HostExperts(SwitchGLU(64, 32, E), HostFormat.INT8, None, "switch_mlp", be)
    gemms = host.gemms()
    assert gemms.runs is not None
    calls: list[tuple[list[int], list[int]]] = []

    def gate_up(rows, ids, bounds, out):
        calls.append((ids.tolist(), bounds.tolist()))
        gemms.runs.gate_up(rows, ids, bounds, out)

    counted = dataclasses.replace(gemms, runs=dataclasses.replace(gemms.runs, gate_up=gate_up))
    rng = np.random.default_rng(4)
    t = 300
    x = rng.standard_normal((t, 64)).astype(np.float32)
    chosen = np.stack([np.full(t, 4), rng.choice([0, 1, 3], t)], axis=1)  # 2, 5 get none
    chosen[::2] = chosen[::2, ::-1]
    chosen[:5, 1] = 5  # 5 tokens of expert 5 (it follows the run of 300, in a group of its own)
    act = lambda h: swiglu_halves(h, backend=be)  # noqa: E731
    got = host_experts.expert_outputs(x, chosen, counted, act)
    want = host_experts.expert_outputs(x, chosen, dataclasses.replace(gemms, runs=None), act)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    groups = host_experts._groups(np.bincount(chosen.reshape(-1), minlength=E).tolist())
    assert calls == [([e for e, _, _ in g], [0, *(b - g[0][1] for _, _, b in g)]) for g in groups]
    assert [ids for ids, _ in calls] == [[0, 1], [3], [4], [5]]  # up to 256 rows a group; 4: 300
    if runs_here(HostFormat.BF16):
        bf16 = HostExperts(SwitchGLU(64, 32, E), HostFormat.BF16, None, "switch_mlp", be)
        assert bf16.gemms().runs is None
