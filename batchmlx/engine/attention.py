"""Attention for paged steps, passed to the model for the duration of a forward step.

mlx-lm model modules bind `scaled_dot_product_attention` at import and call it with the layer's
cache: that call is the only seam. `AttentionRoute` points it, for one step, at an attention
that, for a PagedLayerCache, runs a packed step segment by segment (`packed_attention`), a
padded step holding a shared prefix through `cascade_attention`, and anything else through the
original; it puts the original back afterwards, so nothing outside a paged step (another
engine, plain mlx-lm generation in the same process) ever sees a changed module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from batchmlx.engine.kv_cache import PackedLayout, PagedLayerCache, SegmentKind

Attention = Callable[..., mx.array]  # mlx-lm's scaled_dot_product_attention signature
PrefixAttention = Callable[
    [mx.array, mx.array, mx.array, tuple[mx.array, mx.array], float, mx.array], mx.array
]
# queries [B, Hq, Q, D], keys/values [B, H, K, D], scale, mask [B, 1, Q, K] bool -> [B, Hq, Q, D]
SegmentAttention = Callable[[mx.array, mx.array, mx.array, float, mx.array], mx.array]


def segment_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array
) -> mx.array:
    """The attention of one segment of a packed step (a batch of decodes, or one prompt
    chunk against its keys with a causal mask): the one place a faster kernel plugs in."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def packed_attention(
    queries: mx.array,
    cache: PagedLayerCache,
    scale: float,
    attend: SegmentAttention,
    prefix_attention: PrefixAttention,
    sinks: mx.array | None = None,
) -> mx.array:
    """queries [T, Hq, 1, D] of a PackedLayout, regrouped by segment, answered in row order.

    One-token rows attend as a batch [B, Hq, 1, D]; a prompt chunk's rows become one sequence
    [1, Hq, L, D] with a causal mask; similar chunks become a padded batch [B, Hq, Q, D]; a
    segment whose sequences share leading blocks runs the cascade."""
    layout = cache.layout
    assert isinstance(layout, PackedLayout)
    if sinks is not None:  # (models with sinks also slide windows, which are not paged yet)
        raise NotImplementedError("attention sinks in packed steps: use mixed_steps=False")
    outs = []
    for seg, (keys, values, prefix) in zip(layout.segments, cache.segment_kv, strict=True):
        q = queries[seg.first : seg.first + seg.length]  # [n, Hq, 1, D]
        hq, d = q.shape[1], q.shape[3]
        if seg.kind is SegmentKind.CHUNK:
            q = q.transpose(2, 1, 0, 3)  # [1, Hq, L, D]
        elif seg.kind is SegmentKind.CHUNKS:
            q = q[seg.pad_rows].reshape(seg.batch, seg.queries, hq, d).transpose(0, 2, 1, 3)
        if prefix is not None:
            o = prefix_attention(q, keys, values, prefix, scale, seg.mask)
        else:
            o = attend(q, keys, values, scale, seg.mask)
        if seg.kind is SegmentKind.CHUNK:
            o = o.transpose(2, 1, 0, 3)
        elif seg.kind is SegmentKind.CHUNKS:
            o = o.transpose(0, 2, 1, 3).reshape(-1, hq, 1, d)[seg.real_rows]
        outs.append(o)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def cascade_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    prefix: tuple[mx.array, mx.array],
    scale: float,
    mask: mx.array,
) -> mx.array:
    """Attention over [a prefix every sequence shares] + [each sequence's own keys].

    The prefix part runs all sequences' queries against one copy of the shared keys; the two
    partial softmaxes are merged by their maxima and sums (the log-sum-exp merge), which equals
    attention over the concatenated keys.
    queries [B, Hq, Q, D]; keys, values [B, H, Ks, D]; prefix [H, Kp, D] each; mask [B, 1, Q, Ks].
    """
    b, hq, ql, d = queries.shape
    kp, vp = prefix
    h = kp.shape[0]
    rep = hq // h
    q = (queries * scale).reshape(b, h, rep * ql, d)  # query heads h*rep + r share kv head h

    qp = q.transpose(1, 0, 2, 3).reshape(h, b * rep * ql, d)
    s1 = qp @ kp.swapaxes(-1, -2)
    m1 = s1.max(axis=-1, keepdims=True)
    p1 = mx.exp(s1 - m1)

    def per_seq(x: mx.array) -> mx.array:  # [H, B*rep*Q, X] -> [B, H, rep*Q, X]
        return x.reshape(h, b, rep * ql, x.shape[-1]).transpose(1, 0, 2, 3)

    o1, l1, m1 = per_seq(p1 @ vp), per_seq(p1.sum(axis=-1, keepdims=True)), per_seq(m1)

    s2 = (q @ keys.swapaxes(-1, -2)).reshape(b, h, rep, ql, -1)
    s2 = mx.where(mask[:, :, None], s2, mx.array(-mx.inf, s2.dtype)).reshape(b, h, rep * ql, -1)
    m2 = s2.max(axis=-1, keepdims=True)
    p2 = mx.exp(s2 - m2)
    o2, l2 = p2 @ values, p2.sum(axis=-1, keepdims=True)

    m = mx.maximum(m1, m2)
    a1, a2 = mx.exp(m1 - m), mx.exp(m2 - m)
    out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
    return out.reshape(b, hq, ql, d)


def paged_attention(
    original: Attention,
    prefix_attention: PrefixAttention,
    attend: SegmentAttention = segment_attention,
) -> Attention:
    """mlx-lm's attention with packed steps run by segment and padded steps that share a
    prefix sent to `prefix_attention`."""

    def sdpa(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        if isinstance(cache, PagedLayerCache) and isinstance(cache.layout, PackedLayout):
            return packed_attention(queries, cache, scale, attend, prefix_attention, sinks)
        if isinstance(cache, PagedLayerCache) and cache.prefix is not None and sinks is None:
            return prefix_attention(queries, keys, values, cache.prefix, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                        sinks=sinks, **kw)  # fmt: skip

    return sdpa


class AttentionRoute:
    """Where a model's attention is looked up, and what a paged step puts there."""

    def __init__(
        self,
        model: Any,
        prefix_attention: PrefixAttention = cascade_attention,
        attend: SegmentAttention = segment_attention,
    ) -> None:
        self.module = sys.modules.get(type(model).__module__)
        self.original: Attention | None = getattr(self.module, "scaled_dot_product_attention", None)
        self.paged = (
            None
            if self.original is None
            else paged_attention(self.original, prefix_attention, attend)
        )

    @contextmanager
    def active(self) -> Iterator[None]:
        """The paged attention in place for the body of the with-statement."""
        if self.paged is None:  # an architecture without the seam: attention as it is
            yield
            return
        self.module.scaled_dot_product_attention = self.paged
        try:
            yield
        finally:
            self.module.scaled_dot_product_attention = self.original
