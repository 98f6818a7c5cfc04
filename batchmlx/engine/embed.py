"""Embeddings from a generative model: mean-pooled, L2-normalized final hidden states (what
llama.cpp's `--pooling mean` does for a decoder model).

Inputs are sorted by length and run in right-padded batches without a KV cache: causal
attention means a real token never sees the padding after it, so the padding needs no mask.
There is no generation loop; a batch of inputs is one forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

MAX_BATCH_TOKENS = 4096  # padded tokens per forward pass


class Embedder:
    def __init__(self, model: Any) -> None:
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "embed_tokens"):
            raise ValueError("this model's layout has no hidden-state body to pool")
        self._body = inner  # mlx-lm's inner model returns the final-normed hidden states
        args = getattr(model, "args", None)
        self.dimensions = int(getattr(args, "hidden_size", 0) or inner.embed_tokens.weight.shape[1])

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One unit-length float32 vector per token list, in input order."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        out: list[np.ndarray | None] = [None] * len(inputs)
        start = 0
        while start < len(order):
            # grow the group while the padded size (longest × count) stays in budget
            end = start + 1
            while end < len(order) and len(inputs[order[end]]) * (end + 1 - start) <= max(
                MAX_BATCH_TOKENS, len(inputs[order[start]])
            ):
                end += 1
            group = order[start:end]
            for i, vec in zip(group, self._pool([inputs[i] for i in group]), strict=True):
                out[i] = vec
            start = end
        return out  # type: ignore[return-value]

    def _pool(self, group: list[Sequence[int]]) -> list[np.ndarray]:
        longest = max(len(t) for t in group)
        tokens = np.zeros((len(group), longest), dtype=np.int32)
        valid = np.zeros((len(group), longest, 1), dtype=np.float32)
        for r, ids in enumerate(group):
            tokens[r, : len(ids)] = ids
            valid[r, : len(ids)] = 1.0
        hidden = self._body(mx.array(tokens)).astype(mx.float32)  # [B, L, H]
        mask = mx.array(valid)
        mean = (hidden * mask).sum(axis=1) / mask.sum(axis=1)
        unit = mean / mx.maximum(mx.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)
        host = np.array(unit)
        return [host[r] for r in range(len(group))]
