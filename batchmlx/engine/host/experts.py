"""A mixture-of-experts MLP on the host, in numpy: each token's experts chosen from its router
logits, the tokens routed to each expert gathered into one GEMM per expert, and each token's
output the weighted sum of its experts' outputs (qwen3_moe, olmoe: engine/host/family.py's
Routing). The host step calls it (engine/host/step.py), and so does the MLX path through a
host-format SwitchGLU (engine/host/linear.py's HostExperts).

Batch invariance (docs/engine.md): a token's bits do not depend on its neighbours. Its router
row is one row of a GEMM whose rows are computed alone (tests/engine/test_invariance.py), its
softmax and top-k are over that row only, each expert GEMM's row is its input row's whatever
the number of rows routed there, and its weighted sum runs over its own k experts in ascending
expert order, one add at a time. Which other tokens share an expert changes only M.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Gemm = Callable[[np.ndarray], np.ndarray]  # rows [M, K] float32 -> [M, N] float32


@dataclass(frozen=True, slots=True)
class Routed:
    """Each token's chosen experts and their weights."""

    experts: np.ndarray  # [T, k] int64, each row ascending
    weights: np.ndarray  # [T, k] float32


def route(logits: np.ndarray, top_k: int, norm_topk_prob: bool) -> Routed:
    """mlx-lm's routing (qwen3_moe, olmoe) of router logits [T, E]: softmax over all experts in
    float32, the top_k largest, their probabilities renormalized to sum 1 if norm_topk_prob."""
    p = logits - logits.max(axis=1, keepdims=True)
    np.exp(p, out=p)
    p /= p.sum(axis=1, keepdims=True)
    chosen = np.sort(np.argpartition(-p, top_k - 1, axis=1)[:, :top_k], axis=1)
    weights = np.take_along_axis(p, chosen, axis=1)
    if norm_topk_prob:
        weights /= weights.sum(axis=1, keepdims=True)
    return Routed(chosen.astype(np.int64), weights)


def expert_outputs(
    x: np.ndarray,
    experts: np.ndarray,
    gate_up: Sequence[Gemm],
    down: Sequence[Gemm],
    act: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """Each token's output [T, k, D] from each of its experts [T, k] (any order): expert e's MLP
    down[e](act(gate_up[e](rows))) over the rows of x [T, D] routed to it, one GEMM pair per
    expert that has any."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = np.argsort(flat, kind="stable")  # (token, slot) pairs grouped by expert
    counts = np.bincount(flat, minlength=len(gate_up))
    out = np.empty((t * k, x.shape[1]), np.float32)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        out[pairs] = down[e](act(gate_up[e](x[pairs // k])))
    return out.reshape(t, k, -1)


def combine(outputs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """sum_j weights[:, j] * outputs[:, j] [T, D], added in slot order one at a time (a fixed
    order for each token, whatever T)."""
    y = outputs[:, 0] * weights[:, 0:1]
    for j in range(1, outputs.shape[1]):
        y += outputs[:, j] * weights[:, j : j + 1]
    return y
