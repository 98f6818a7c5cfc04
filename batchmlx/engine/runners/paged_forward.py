"""The forward step: one ragged batch through an mlx-lm model over paged KV."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from batchmlx.engine.host.linear import HostLinear
from batchmlx.engine.host.step import HostStep
from batchmlx.engine.kernels.attention import (
    AttentionRoute,
    PrefixAttention,
    shared_prefix_attention,
)
from batchmlx.engine.kv.paged import BatchLayout, PackedLayout, PagedKVStorage, PagedLayerCache


def model_dims(model: nn.Module) -> tuple[int, int, int]:
    """(num_layers, n_kv_heads, head_dim) of an mlx-lm transformer."""
    layers = model.layers
    attn = layers[0].self_attn
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
    head_dim = getattr(attn, "head_dim", None)
    if head_dim is None:
        head_dim = _outputs(attn.k_proj) // n_kv
    return len(layers), int(n_kv), int(head_dim)


def _outputs(layer: nn.Module) -> int:
    """A linear layer's output features, in any of its forms."""
    if isinstance(layer, HostLinear):  # one reader of a (maybe shared) host GEMM: its slice
        start, end = layer._gemm.splits[layer._index]
        return end - start
    if hasattr(layer, "bits"):  # quantized: packed columns, rows are outputs
        return int(layer.scales.shape[0])
    return int(layer.weight.shape[0])


class PagedForward:
    """Runs the model body on a BatchLayout and turns chosen hidden rows into logits.

    The body and the head are split so a 500-token prefill pays for the vocabulary projection
    of its last token only, not of all 500.
    """

    def __init__(
        self,
        model: nn.Module,
        storage: PagedKVStorage,
        prefix_attention: PrefixAttention = shared_prefix_attention,
        *,
        host_steps: bool = True,
    ) -> None:
        """host_steps False: every step in MLX (the engine's probe of the MLX path)."""
        self.model = model
        self.storage = storage
        self.body, self.head = _split(model)
        self.attention = AttentionRoute(model, prefix_attention)
        # packed steps on the host alone, where the model is one it runs (engine/host/step.py)
        self.host = HostStep.of(model, storage) if host_steps else None

    @property
    def packs(self) -> bool:
        """Whether this model can run PackedLayout steps: the host step runs them, or its
        attention has the seam the packed attention in MLX needs (else steps use the padded
        BatchLayout, unmixed)."""
        return self.host is not None or self.attention.paged is not None

    @property
    def packs_windows(self) -> bool:
        """Whether packed steps may hold sliding-window layers: the host step masks each
        window's keys; MLX's packed attention does not (those models run padded steps)."""
        return self.host is not None

    def forward(self, layout: BatchLayout | PackedLayout, rows: list[int] | None) -> mx.array:
        """Hidden states of each sequence's last new token → logits [len(rows), V].

        rows: which sequences of the layout need logits (None = all)."""
        if self.host is not None and self.host.runs(layout):
            assert isinstance(layout, PackedLayout)
            return self.host.forward(layout, rows)
        caches = [PagedLayerCache(self.storage, i, layout) for i in range(self.storage.num_layers)]
        with self.attention.active():  # the graph is built here; evaluation comes later
            hidden = self.body(layout.tokens, caches)  # [B, Q, H], packed: [T, 1, H]
        if isinstance(layout, PackedLayout):
            last = hidden[layout.last_index, 0, :]
        else:
            last = mx.take_along_axis(hidden, layout.last_index[:, None, None], axis=1)[:, 0, :]
        if rows is not None and len(rows) != last.shape[0]:
            last = last[mx.array(rows, dtype=mx.int32)]
        return self.head(last)


def _split(model: nn.Module) -> tuple[Any, Any]:
    inner = getattr(model, "model", None)
    args = getattr(model, "args", None)
    if inner is not None and hasattr(inner, "embed_tokens"):

        def body(tokens, cache):
            return inner(tokens, cache)

        if hasattr(model, "lm_head"):
            head = model.lm_head
        elif args is not None and getattr(args, "tie_word_embeddings", True):
            head = inner.embed_tokens.as_linear
        else:  # pragma: no cover - unknown layout
            head = None
        if head is not None:
            return body, head

    # Unknown layout: run the whole model and take logits per position (slower, still correct).
    def body_full(tokens, cache):
        return model(tokens, cache=cache)

    return body_full, lambda x: x
