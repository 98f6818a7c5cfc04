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

Slices: `slices` runs the work one forward pass at a time, each of at most `SLICE_TOKENS` new
tokens (padding counted), yielding after each, so the worker can put generation steps between
them: one request of 2,048 long inputs never holds the engine for more than one pass. An input
longer than a slice runs in chunks of whole blocks across passes, on top of its own keys and
values (as chunked prefill does), its hidden-state sum carried along.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

SLICE_TOKENS = 256  # padded new tokens per forward pass: one slice between generation steps
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
        self.vocab_size = int(inner.embed_tokens.weight.shape[0])  # rows: valid ids are below
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[tuple[int, ...], _Block] = OrderedDict()
        self.stats = EmbedStats()

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One unit-length float32 vector per token list, in input order (every slice run)."""
        out: list[np.ndarray | None] = [None] * len(inputs)
        for done in self.slices(inputs):
            for i, vec in done:
                out[i] = vec
        return out  # type: ignore[return-value]

    def slices(
        self, inputs: Sequence[Sequence[int]], budget: int = SLICE_TOKENS
    ) -> Iterator[list[tuple[int, np.ndarray]]]:
        """The work of `embed`, one forward pass of at most `budget` new tokens per `next`:
        each yields the (input index, vector) pairs that pass finished (often none).

        Raises ValueError up front for a token id the embedding table has no row for: MLX
        does not check a gather's indices, and reading past the table is a segfault."""
        for ids in inputs:
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the vocabulary ({self.vocab_size})")
        bs = self.block_size
        width = max(bs, budget // bs * bs)  # whole blocks per chunk, so cached blocks line up
        groups: dict[int, list[int]] = {}
        for i, ids in enumerate(inputs):
            groups.setdefault(self._cached_blocks(ids), []).append(i)
        for p, members in groups.items():
            members.sort(key=lambda i: len(inputs[i]))
            start = 0
            while start < len(members):
                end = start + 1
                while (
                    end < len(members)
                    and (len(inputs[members[end]]) - p * bs) * (end + 1 - start) <= budget
                ):
                    end += 1
                chunk = members[start:end]
                rows = [inputs[i] for i in chunk]
                # blocks may have been evicted since grouping (other passes kept theirs)
                p_now = min(p, *(self._cached_blocks(ids) for ids in rows))
                for vectors in self._pool(rows, p_now, width):
                    yield list(zip(chunk, vectors, strict=True)) if vectors else []
                start = end

    def _cached_blocks(self, ids: Sequence[int]) -> int:
        """Leading blocks of `ids` in the cache; at least one token is left to run, so every
        pass has a row to compute."""
        bs, limit = self.block_size, (len(ids) - 1) // self.block_size
        p = 0
        while p < limit and tuple(ids[: (p + 1) * bs]) in self._blocks:
            p += 1
        return p

    def _pool(
        self, group: list[Sequence[int]], p: int, width: int
    ) -> Iterator[list[np.ndarray] | None]:
        """Rows that share `p` cached leading blocks: run the rest on top of their KV, in
        chunks of `width` columns, one forward pass per `next`; None until the last pass,
        which gives the rows' vectors."""
        from mlx_lm.models.cache import make_prompt_cache

        bs, skip = self.block_size, p * self.block_size
        rest = [list(ids[skip:]) for ids in group]
        longest = max(len(t) for t in rest)
        caches = make_prompt_cache(self._model)
        total = mx.zeros((len(group), self.dimensions), dtype=mx.float32)
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
            total = mx.stack([sum(b.hidden_sum for b in row) for row in blocks])
            self.stats.reused_tokens += skip * len(group)
        for a in range(0, longest, width):
            b = min(a + width, longest)
            tokens = np.zeros((len(group), b - a), dtype=np.int32)
            valid = np.zeros((len(group), b - a, 1), dtype=np.float32)
            for r, ids in enumerate(rest):
                part = ids[a:b]
                tokens[r, : len(part)] = part
                valid[r, : len(part)] = 1.0
            hidden = self._body(mx.array(tokens), cache=caches).astype(mx.float32)  # [B, L, H]
            total = total + (hidden * mx.array(valid)).sum(axis=1)
            mx.eval(total, hidden)
            self.stats.computed_tokens += int(valid.sum())
            self._keep(group, skip + a, hidden, caches)
            if b < longest:
                yield None
        lengths = mx.array([[float(len(ids))] for ids in group])
        mean = total / lengths
        unit = mean / mx.maximum(mx.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)
        host = np.array(unit)
        yield [host[r] for r in range(len(group))]

    def _hit(self, key: tuple[int, ...]) -> _Block:
        self._blocks.move_to_end(key)
        return self._blocks[key]

    def _keep(self, group: list[Sequence[int]], at: int, hidden: mx.array, caches: list) -> None:
        """Remember the new full blocks of each row that this pass computed (it ran positions
        `at` onwards, a block boundary; least recently used evicted)."""
        if self.max_blocks <= 0:
            return
        bs = self.block_size
        for r, ids in enumerate(group):
            for j in range(at // bs, min(len(ids), at + hidden.shape[1]) // bs):
                key = tuple(ids[: (j + 1) * bs])
                if key in self._blocks:
                    continue
                lo, hi = j * bs, (j + 1) * bs
                # own copies: a slice would keep the whole pass's arrays alive
                block = _Block(
                    hidden_sum=mx.contiguous(hidden[r, lo - at : hi - at].sum(axis=0)),
                    keys=[mx.contiguous(c.keys[r, :, lo:hi, :]) for c in caches],
                    values=[mx.contiguous(c.values[r, :, lo:hi, :]) for c in caches],
                )
                mx.eval(block.hidden_sum, block.keys, block.values)
                self._blocks[key] = block
                if len(self._blocks) > self.max_blocks:
                    self._blocks.popitem(last=False)
