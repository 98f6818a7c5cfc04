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

# out[M, N] float32 = rows [M, K] (float32, or what `prepare` made of them) . W^T
Gemm = Callable[[np.ndarray, np.ndarray], object]
# out[R, N] = run a's expert's GEMM of rows [R, K] bounds[a]:bounds[a + 1], each a < A, in one
# call: (rows, the runs' experts int32 [A], their bounds int32 [A + 1] from 0 to R, out)
RunsGemm = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], object]


@dataclass(frozen=True, slots=True)
class RunsGemms:
    """All of a group's experts' gate-ups in one call, and their downs in another (the int8
    kernel's q8_experts: one hand-off to its threads where one an expert cost more than the
    small GEMMs of decode widths)."""

    gate_up: RunsGemm
    down: RunsGemm


@dataclass(frozen=True, slots=True)
class ExpertGemms:
    """A mixture's experts as host GEMMs (engine/host/linear.py's HostExperts)."""

    gate_up: Sequence[Gemm]  # expert e's gate and up, one GEMM [2I, D]
    down: Sequence[Gemm]  # expert e's down [D, I]
    gate_up_width: int  # N of the gate-up GEMMs (2I)
    # float32 rows -> the GEMMs' input (bf16: their bits), done once for all experts' rows
    # (elementwise: the same bits as each GEMM rounding its own); None: taken as they are
    prepare: Callable[[np.ndarray], np.ndarray] | None = None
    runs: RunsGemms | None = None  # the same GEMMs a group of runs at a time; None: one by one


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
    gemms: ExpertGemms,
    act: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """Each token's output [T, k, D] from each of its experts [T, k] (any order): expert e's MLP
    down[e](act(gate_up[e](rows))) over the rows of x [T, D] routed to it. The (token, slot)
    pairs are sorted by expert, so each expert's rows are one contiguous run: one GEMM pair per
    expert that has any; the input rounded once, and the activation and its rounding once per
    group of consecutive runs of up to GROUP_ROWS rows (fewer calls at decode widths, the
    gate-up output still in cache for a prompt's), and the GEMMs too where `gemms.runs` has
    them so."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = np.argsort(flat, kind="stable")  # (token, slot) pairs grouped by expert
    counts = np.bincount(flat, minlength=len(gemms.gate_up)).tolist()
    prep = gemms.prepare or (lambda rows: rows)
    rows = prep(np.ascontiguousarray(x[order // k]))
    h = np.empty((t * k, gemms.gate_up_width), np.float32)
    y = np.empty((t * k, x.shape[1]), np.float32)
    for group in _groups(counts):
        lo, hi = group[0][1], group[-1][2]
        if gemms.runs is not None:
            ids = np.array([e for e, _, _ in group], np.int32)
            bounds = np.array([0, *(b - lo for _, _, b in group)], np.int32)
            gemms.runs.gate_up(rows[lo:hi], ids, bounds, h[lo:hi])
            gemms.runs.down(prep(act(h[lo:hi])), ids, bounds, y[lo:hi])
            continue
        for e, a, b in group:
            gemms.gate_up[e](rows[a:b], h[a:b])
        acts = prep(act(h[lo:hi]))
        for e, a, b in group:
            gemms.down[e](acts[a - lo : b - lo], y[a:b])
    out = np.empty_like(y)
    out[order] = y
    return out.reshape(t, k, -1)


# rows of consecutive experts activated together (a group's gate-up output, 256 x 2 x 768
# float32 at Qwen3-30B-A3B's width, stays in a core's L2). 8 bf16 experts of 768 at hidden 576,
# 2 a token, one thread, fastest of 60 on a 2-core AVX-512 Xeon at load 5 (2026-12-06), against
# each expert alone: 32 tokens 1.6 / 2.0 ms, 256 tokens 5.2 / 5.4-6.3, 1,024 tokens 19-22 / 19-20
GROUP_ROWS = 256


def _groups(counts: list[int]) -> list[list[tuple[int, int, int]]]:
    """The experts' runs (expert, first row, end) that have rows, in groups of consecutive runs
    of up to GROUP_ROWS rows (a longer run alone)."""
    groups: list[list[tuple[int, int, int]]] = []
    start, size = 0, GROUP_ROWS
    for e, n in enumerate(counts):
        if n == 0:
            continue
        if size + n > GROUP_ROWS:
            groups.append([])
            size = 0
        groups[-1].append((e, start, start + n))
        size += n
        start += n
    return groups


def combine(outputs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """sum_j weights[:, j] * outputs[:, j] [T, D], added in slot order one at a time (a fixed
    order for each token, whatever T)."""
    y = outputs[:, 0] * weights[:, 0:1]
    for j in range(1, outputs.shape[1]):
        y += outputs[:, j] * weights[:, j : j + 1]
    return y
