"""Embeddings from a generative model: mean-pooled, L2-normalized final hidden states (what
llama.cpp's `--pooling mean` does for a decoder model).

Prefix reuse: mean pooling needs the final hidden state of every token, which the generation
KV cache does not keep, so the embedder keeps its own small cache of full blocks: per block the
sum of its tokens' final hidden states and its keys and values per layer, keyed by all tokens up
to the block's end (exact, so a hit is always right). A causal model's hidden state at a
position depends only on the tokens before it, so a cached prefix is never recomputed: only the
rest runs, on top of the prefix's keys and values.

Inputs with the same number of cached blocks run together, sorted by length and right-padded:
causal attention means a real token never sees the padding after it. No generation loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

MAX_BATCH_TOKENS = 4096  # padded new tokens per forward pass
BLOCK_SIZE = 16
MAX_CACHED_BLOCKS = 256  # about 0.7 MB a block for SmolLM2-135M in float32


@dataclass(slots=True)
class _Block:
    hidden_sum: mx.array  # [H] sum of the block's final hidden states (float32)
    keys: list[mx.array]  # per layer [n_kv, BLOCK_SIZE, d]
    values: list[mx.array]


@dataclass(slots=True)
class EmbedStats:
    computed_tokens: int = 0  # tokens run through the model
    reused_tokens: int = 0  # tokens whose hidden states and KV came from the block cache


class Embedder:
    def __init__(
        self, model: Any, block_size: int = BLOCK_SIZE, max_blocks: int = MAX_CACHED_BLOCKS
    ) -> None:
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "embed_tokens"):
            raise ValueError("this model's layout has no hidden-state body to pool")
        # the block cache below stores and restores plain keys and values per layer; rotating
        # (sliding-window) and state-space caches hold something else
        kinds = {type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache}
        if kinds:
            raise ValueError(f"embeddings need plain key/value caches, not {sorted(kinds)}")
        self._model = model
        self._body = inner  # mlx-lm's inner model returns the final-normed hidden states
        args = getattr(model, "args", None)
        self.dimensions = int(getattr(args, "hidden_size", 0) or inner.embed_tokens.weight.shape[1])
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[tuple[int, ...], _Block] = OrderedDict()
        self.stats = EmbedStats()

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One unit-length float32 vector per token list, in input order."""
        bs = self.block_size
        groups: dict[int, list[int]] = {}
        for i, ids in enumerate(inputs):
            # keep at least one token to run, so every pass has a row to compute
            limit = (len(ids) - 1) // bs
            p = 0
            while p < limit and tuple(ids[: (p + 1) * bs]) in self._blocks:
                p += 1
            groups.setdefault(p, []).append(i)
        out: list[np.ndarray | None] = [None] * len(inputs)
        for p, members in groups.items():
            members.sort(key=lambda i: len(inputs[i]))
            start = 0
            while start < len(members):
                end = start + 1
                while end < len(members) and (len(inputs[members[end]]) - p * bs) * (
                    end + 1 - start
                ) <= MAX_BATCH_TOKENS:
                    end += 1
                chunk = members[start:end]
                for i, vec in zip(chunk, self._pool([inputs[i] for i in chunk], p), strict=True):
                    out[i] = vec
                start = end
        return out  # type: ignore[return-value]

    def _pool(self, group: list[Sequence[int]], p: int) -> list[np.ndarray]:
        """Rows that share `p` cached leading blocks: run the rest on top of their KV."""
        from mlx_lm.models.cache import make_prompt_cache

        bs, skip = self.block_size, p * self.block_size
        rest = [list(ids[skip:]) for ids in group]
        longest = max(len(t) for t in rest)
        tokens = np.zeros((len(group), longest), dtype=np.int32)
        valid = np.zeros((len(group), longest, 1), dtype=np.float32)
        for r, ids in enumerate(rest):
            tokens[r, : len(ids)] = ids
            valid[r, : len(ids)] = 1.0
        caches = make_prompt_cache(self._model)
        prefix_sum = mx.zeros((len(group), self.dimensions), dtype=mx.float32)
        if p:
            blocks = [[self._hit(tuple(ids[: (j + 1) * bs])) for j in range(p)] for ids in group]
            for layer, c in enumerate(caches):
                c.keys = mx.stack(
                    [mx.concatenate([b.keys[layer] for b in row], axis=1) for row in blocks]
                )
                c.values = mx.stack(
                    [mx.concatenate([b.values[layer] for b in row], axis=1) for row in blocks]
                )
                c.offset = skip
            prefix_sum = mx.stack([sum(b.hidden_sum for b in row) for row in blocks])
            self.stats.reused_tokens += skip * len(group)
        hidden = self._body(mx.array(tokens), cache=caches).astype(mx.float32)  # [B, L, H]
        mask = mx.array(valid)
        total = prefix_sum + (hidden * mask).sum(axis=1)
        lengths = mx.array([[float(len(ids))] for ids in group])
        mean = total / lengths
        unit = mean / mx.maximum(mx.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)
        mx.eval(unit, hidden)
        self.stats.computed_tokens += sum(len(t) for t in rest)
        self._keep(group, p, hidden, caches)
        host = np.array(unit)
        return [host[r] for r in range(len(group))]

    def _hit(self, key: tuple[int, ...]) -> _Block:
        self._blocks.move_to_end(key)
        return self._blocks[key]

    def _keep(self, group: list[Sequence[int]], p: int, hidden: mx.array, caches: list) -> None:
        """Remember the new full blocks of each row (least recently used evicted)."""
        if self.max_blocks <= 0:
            return
        bs = self.block_size
        for r, ids in enumerate(group):
            for j in range(p, len(ids) // bs):
                key = tuple(ids[: (j + 1) * bs])
                if key in self._blocks:
                    continue
                lo, hi = j * bs, (j + 1) * bs
                # own copies: a slice would keep the whole pass's arrays alive
                block = _Block(
                    hidden_sum=mx.contiguous(hidden[r, lo - p * bs : hi - p * bs].sum(axis=0)),
                    keys=[mx.contiguous(c.keys[r, :, lo:hi, :]) for c in caches],
                    values=[mx.contiguous(c.values[r, :, lo:hi, :]) for c in caches],
                )
                mx.eval(block.hidden_sum, block.keys, block.values)
                self._blocks[key] = block
                if len(self._blocks) > self.max_blocks:
                    self._blocks.popitem(last=False)
