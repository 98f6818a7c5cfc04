"""Attention for paged steps, passed to the model for the duration of a forward step.

mlx-lm model modules bind `scaled_dot_product_attention` at import and call it with the layer's
cache: that call is the only seam. `AttentionRoute` points it, for one step, at an attention
that, for a PagedLayerCache, runs a packed step segment by segment (`packed_attention`), a
padded step holding a shared prefix through `cascade_attention`, any other paged step through
`chunked_attention`, and anything else through the original; it puts the original back
afterwards, so nothing outside a paged step (another engine, plain mlx-lm generation in the same
process) ever sees a changed module.

Why not MLX's own attention on CPU: its exp costs ~10-13 ns per score element (scalar libm on
x86), its boolean mask is a `where` pass at ~3 ns, and it scores the whole upper triangle of a
prompt. `chunked_attention` computes exp with a polynomial in plain elementwise ops (~1-2 ns),
adds a float mask built once per step, and walks the queries in tiles whose score block stays
in L2, skipping the keys every query of a tile is masked from (half the work of a prompt).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from batchmlx.engine.host.attention import host_attention, host_cascade_attention, pays
from batchmlx.engine.host.elementwise import host_swiglu
from batchmlx.engine.host.elementwise import pays as host_swiglu_pays
from batchmlx.engine.kernels.elementwise import (
    StepRoPE,
    exp_nonpositive,
    exp_shifted,
    fast_swiglu,
    is_mlx_lm_swiglu,
    plain_ropes,
)
from batchmlx.engine.kv.paged import PackedLayout, PagedLayerCache, Segment, SegmentKind

Attention = Callable[..., mx.array]  # mlx-lm's scaled_dot_product_attention signature
# (queries, keys, values, prefix, scale, mask, *, causal_offset, real_rows) -> output
PrefixAttention = Callable[..., mx.array]

# Query rows per tile: with 9 query heads a tile of 1,000 keys is 9 * 64 * 1000 * 4 B ~ 2.3 MB,
# about the L2 of this class of machine; smaller tiles pay more per-op overhead.
CHUNK_QUERIES = 64


def cpu_kernels(device: mx.Device | None = None) -> bool:
    """Whether the CPU kernels below pay: they stand in for MLX's scalar CPU exp; on a GPU
    (Metal, CUDA) MLX's own fused attention and activations are the fast ones."""
    return (device or mx.default_device()).type == mx.DeviceType.cpu


# The route's choice for paged steps without a shared prefix: True = chunked_attention, False =
# mlx-lm's own (the engine before this attention; benchmarks flip it to measure both in one run).
FAST_ATTENTION = cpu_kernels()
# mlx-lm's swiglu (MLP activation) swapped for kernels.fast_swiglu during a step; False: as is
FAST_SWIGLU = cpu_kernels()
# Where the fast attention runs: True = on the host in numpy (host_attention.py, 3-4x faster on
# the CPU backend) when the call has enough scores to pay for leaving MLX, False = always the
# same tiles as MLX ops (chunked_attention, cascade_attention)
HOST_ATTENTION = cpu_kernels()
# nn.RoPE swapped for kernels.StepRoPE during a step (one cos/sin table a step, not one a
# call); False: as is
STEP_ROPE = cpu_kernels()
# Where a large swiglu runs: True = on the host (host_kernels.py; 25 -> 2 ms a layer on 1,270
# tokens, measured alone), False = always kernels.fast_swiglu
HOST_SWIGLU = cpu_kernels()


def additive_mask(mask: mx.array | None, dtype: mx.Dtype = mx.float32) -> mx.array | None:
    """A boolean mask (True = attend) as 0 / -inf to add to scores; float masks pass through."""
    if mask is None or mask.dtype != mx.bool_:
        return mask
    return mx.where(mask, mx.array(0.0, dtype), mx.array(-mx.inf, dtype))


def with_ones(values: mx.array) -> mx.array:
    """values [..., K, D] -> [..., K, D + 1] with a column of ones: p @ that gives p @ values
    and p's row sums from one matmul. Worth its copy of the values when the queries per kv head
    outnumber D (a prompt); a decode step sums its few score rows instead."""
    values = _f32(values)
    return mx.concatenate([values, mx.ones((*values.shape[:-1], 1), mx.float32)], axis=-1)


def softmax_parts(
    q: mx.array, k: mx.array, v: mx.array, bias: mx.array | None, *, ones: bool = False
) -> tuple[mx.array, mx.array, mx.array]:
    """Unnormalised attention of scaled queries: (exp(s - m) @ v, row sums, row maxima m).

    q [..., R, D], k [..., K, D], v [..., K, Dv] (or [..., K, Dv + 1] from `with_ones` when
    `ones`), bias broadcastable to the scores [..., R, K]."""
    s = q @ k.swapaxes(-1, -2)
    if bias is not None:
        s = s + bias
    m = s.max(axis=-1, keepdims=True)
    p = exp_shifted(s, m)
    if ones:
        ov = p @ v
        return ov[..., :-1], ov[..., -1:], m
    return p @ v, p.sum(axis=-1, keepdims=True), m


def _values(values: mx.array, rows: int) -> tuple[mx.array, bool]:
    """The values as softmax_parts reads them for `rows` score rows per kv head and key."""
    if rows > values.shape[-1]:
        return with_ones(values), True
    return _f32(values), False


def chunked_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | str | None,
    *,
    causal_offset: int | None = None,
    chunk: int | None = None,
) -> mx.array:
    """softmax(q k^T * scale + mask) v, tile by tile over the queries (mlx-lm's sdpa, numerically).

    queries [B, Hq, Q, D]; keys, values [B, H, K, D] with Hq = rep * H (query head h*rep + r
    reads kv head h); mask [B or 1, 1, Q, K] bool (True = attend) or additive float, "causal"
    (the last Q of K positions, each seeing itself and before), or None.
    causal_offset: query i attends to no key index past causal_offset + i (a prompt starting at
    position p over keys from position 0: p); tiles then skip the keys no query of theirs sees.
    Every query must attend to at least one key. Returns [B, Hq, Q, D] in the queries' dtype.
    """
    b, hq, ql, d = queries.shape
    h, kl = keys.shape[1], keys.shape[2]
    rep = hq // h
    out_dtype = queries.dtype
    if mask is not None and isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        causal_offset = kl - ql if causal_offset is None else causal_offset
        bias = _causal_bias(ql, kl, kl - ql)
    else:
        bias = additive_mask(mask)
    # float32 throughout: the polynomial exp is exact to float32 only
    q = (_f32(queries) * scale).reshape(b, h, rep, ql, d)
    tile = chunk or CHUNK_QUERIES
    k, (v, ones) = _f32(keys), _values(values, rep * min(tile, ql))
    if bias is not None:
        bias = bias.astype(mx.float32)[:, :, None]  # [B, 1, 1, Q, K]: broadcast over rep
    outs = []
    for q0 in range(0, ql, tile):
        q1 = min(ql, q0 + tile)
        kc = _keys_seen(kl, causal_offset, q1, tile)
        qc = (q if q1 - q0 == ql else q[:, :, :, q0:q1]).reshape(b, h, rep * (q1 - q0), d)
        bc = None if bias is None else _tile_bias(bias, q0, q1, kc, rep)
        kt, vt = (k, v) if kc == kl else (k[:, :, :kc], v[:, :, :kc])
        o, total, _ = softmax_parts(qc, kt, vt, bc, ones=ones)
        outs.append((o / total).reshape(b, h, rep, q1 - q0, d))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(b, hq, ql, d).astype(out_dtype)


def _keys_seen(kl: int, causal_offset: int | None, q1: int, tile: int) -> int:
    """Keys a tile ending at query q1 reads: all, unless skipping saves at least a tile's worth
    (a slice of the keys is a copy for the matmul; a decode step would pay it to skip a few)."""
    if causal_offset is None:
        return kl
    kc = max(1, causal_offset + q1)
    return kc if kc <= kl - tile else kl


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _causal_bias(ql: int, kl: int, offset: int) -> mx.array:
    allowed = mx.arange(kl)[None, :] <= (mx.arange(ql) + offset)[:, None]
    return additive_mask(allowed[None, None])


def _tile_bias(bias: mx.array, q0: int, q1: int, kc: int, rep: int) -> mx.array:
    """The bias of queries q0:q1 and keys :kc, shaped to add to scores [B, H, rep*(q1-q0), kc]."""
    tb = bias[..., q0:q1, :kc]  # [B, 1, 1, T, kc]
    if rep == 1 or q1 - q0 == 1:  # broadcasts as it is (a decode step: no copy)
        return tb[:, :, 0]
    tb = mx.broadcast_to(tb, (tb.shape[0], 1, rep, q1 - q0, kc))
    return tb.reshape(tb.shape[0], 1, rep * (q1 - q0), kc)


def cascade_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    prefix: tuple[mx.array, mx.array],
    scale: float,
    mask: mx.array,
    *,
    causal_offset: int | None = None,
) -> mx.array:
    """Attention over [a prefix every sequence shares] + [each sequence's own keys].

    The prefix part runs all sequences' queries against one copy of the shared keys; the two
    partial softmaxes are merged by their maxima and sums (the log-sum-exp merge), which equals
    attention over the concatenated keys. Queries go in tiles as in `chunked_attention`.
    queries [B, Hq, Q, D]; keys, values [B, H, Ks, D]; prefix [H, Kp, D] each; mask [B, 1, Q, Ks]
    bool (True = attend) or additive float; causal_offset as in `chunked_attention`, counted in
    the sequences' own keys.
    """
    b, hq, ql, d = queries.shape
    kp = _f32(prefix[0])
    h, ks = kp.shape[0], keys.shape[2]
    rep = hq // h
    q = (_f32(queries) * scale).reshape(b, h, rep, ql, d)  # query heads h*rep + r share head h
    tile = min(CHUNK_QUERIES, ql)
    k, (v, ones) = _f32(keys), _values(values, rep * tile)
    vp, ones_p = _values(prefix[1], b * rep * tile)
    bias = _f32(additive_mask(mask))[:, :, None]  # [B, 1, 1, Q, Ks]
    outs = []
    for q0 in range(0, ql, tile):
        q1 = min(ql, q0 + tile)
        t = q1 - q0
        kc = _keys_seen(ks, causal_offset, q1, tile)
        qc = (q if t == ql else q[:, :, :, q0:q1]).reshape(b, h, rep * t, d)

        qp = qc.transpose(1, 0, 2, 3).reshape(h, b * rep * t, d)  # every sequence, one prefix
        o1, l1, m1 = (
            x.reshape(h, b, rep * t, x.shape[-1]).transpose(1, 0, 2, 3)
            for x in softmax_parts(qp, kp, vp, None, ones=ones_p)
        )
        bc = _tile_bias(bias, q0, q1, kc, rep)
        kt, vt = (k, v) if kc == ks else (k[:, :, :kc], v[:, :, :kc])
        o2, l2, m2 = softmax_parts(qc, kt, vt, bc, ones=ones)

        m = mx.maximum(m1, m2)
        a1, a2 = exp_nonpositive(m1 - m), exp_nonpositive(m2 - m)
        out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
        outs.append(out.reshape(b, h, rep, t, d))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(b, hq, ql, d).astype(queries.dtype)


def step_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """The swiglu of a paged step on the CPU: a prompt-sized one on the host, else fused MLX."""
    if HOST_SWIGLU and host_swiglu_pays(gate, x):
        return host_swiglu(gate, x)
    return fast_swiglu(gate, x)


def tiled_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | str | None,
    *,
    causal_offset: int | None = None,
) -> mx.array:
    """The fast attention without a shared prefix: on the host where it pays, else MLX tiles."""
    host = HOST_ATTENTION and pays(queries, keys.shape[2])
    kernel = host_attention if host else chunked_attention
    return kernel(queries, keys, values, scale, mask, causal_offset=causal_offset)


def shared_prefix_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    prefix: tuple[mx.array, mx.array],
    scale: float,
    mask: mx.array,
    *,
    causal_offset: int | None = None,
    real_rows: mx.array | None = None,
) -> mx.array:
    """The cascade over a shared prefix: on the host where it pays, else as MLX tiles.
    real_rows (padded chunks): the real queries, b * Q + i; the MLX tiles compute them all."""
    host = HOST_ATTENTION and pays(queries, prefix[0].shape[1] + keys.shape[2])
    if host:
        return host_cascade_attention(queries, keys, values, prefix, scale, mask,
                                      causal_offset=causal_offset, real_rows=real_rows)  # fmt: skip
    return cascade_attention(queries, keys, values, prefix, scale, mask,
                             causal_offset=causal_offset)  # fmt: skip


# (queries [B, Hq, Q, D], keys/values [B, H, K, D], scale, mask [B, 1, Q, K] bool or additive,
# *, causal_offset) -> [B, Hq, Q, D]
SegmentAttention = Callable[..., mx.array]


def segment_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array,
    *,
    causal_offset: int | None = None,
) -> mx.array:
    """The attention of one segment of a packed step (a batch of decodes, or one prompt
    chunk against its keys with a causal mask): the one place a faster kernel plugs in."""
    if FAST_ATTENTION:
        return tiled_attention(queries, keys, values, scale, mask, causal_offset=causal_offset)
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
    if sinks is not None:  # (models with sinks also slide windows, which run padded steps)
        raise NotImplementedError("attention sinks in packed steps: use mixed_steps=False")
    # the layer's gathered keys and values are read here only: dropped now, they are freed as
    # soon as evaluated, not held by the cache object until the step ends
    segment_kv, cache.segment_kv = cache.segment_kv, []
    outs = [
        _segment(queries, seg, kv, scale, attend, prefix_attention)
        for seg, kv in zip(layout.segments, segment_kv, strict=True)
    ]
    del segment_kv
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _segment(
    queries: mx.array,
    seg: Segment,
    kv: tuple[mx.array, mx.array, tuple[mx.array, mx.array] | None],
    scale: float,
    attend: SegmentAttention,
    prefix_attention: PrefixAttention,
) -> mx.array:
    """One segment of a packed step: its rows regrouped, attended, back in row order."""
    keys, values, prefix = kv
    q = queries[seg.first : seg.first + seg.length]  # [n, Hq, 1, D]
    hq, d = q.shape[1], q.shape[3]
    if seg.kind is SegmentKind.CHUNK:
        q = q.transpose(2, 1, 0, 3)  # [1, Hq, L, D]
    elif seg.kind is SegmentKind.CHUNKS:
        q = q[seg.pad_rows].reshape(seg.batch, seg.queries, hq, d).transpose(0, 2, 1, 3)
    plan = seg.dense  # the decodes' dense KV: queries in slot order, its own mask
    bias, mask, offset = seg.bias, seg.mask, seg.causal_offset
    if plan is not None:
        q = q if plan.slot_rows is None else q[plan.slot_rows]
        bias, mask, offset = plan.bias, plan.mask, None
    if prefix is not None:
        # real_rows (padded chunks): the host cascade skips the padding's prefix part
        o = prefix_attention(q, keys, values, prefix, scale, bias, causal_offset=offset,
                             real_rows=seg.real_rows)  # fmt: skip
    else:
        o = attend(q, keys, values, scale, bias if FAST_ATTENTION else mask, causal_offset=offset)
    if plan is not None:
        return o if plan.row_slots is None else o[plan.row_slots]
    if seg.kind is SegmentKind.CHUNK:
        o = o.transpose(2, 1, 0, 3)
    elif seg.kind is SegmentKind.CHUNKS:
        o = o.transpose(0, 2, 1, 3).reshape(-1, hq, 1, d)[seg.real_rows]
    return o


def paged_attention(
    original: Attention,
    prefix_attention: PrefixAttention,
    attend: SegmentAttention = segment_attention,
) -> Attention:
    """mlx-lm's attention with packed steps run by segment, and padded paged steps sent to
    `prefix_attention` (a shared prefix) or `chunked_attention` (none), with the step's additive
    mask and causal offset."""

    def sdpa(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        if isinstance(cache, PagedLayerCache) and isinstance(cache.layout, PackedLayout):
            return packed_attention(queries, cache, scale, attend, prefix_attention, sinks)
        if isinstance(cache, PagedLayerCache) and sinks is None:
            lay = cache.layout
            # the step's mask as 0/-inf, built once for every layer (a window layer's own mask
            # is another array: it goes as it is)
            bias = lay.bias if mask is lay.mask and lay.bias is not None else mask
            if cache.prefix is not None:
                prefix, cache.prefix = cache.prefix, None  # read here only (see packed_attention)
                return prefix_attention(queries, keys, values, prefix, scale, bias,
                                        causal_offset=lay.causal_offset)  # fmt: skip
            if FAST_ATTENTION:
                return tiled_attention(queries, keys, values, scale, bias,
                                       causal_offset=lay.causal_offset)  # fmt: skip
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                        sinks=sinks, **kw)  # fmt: skip

    return sdpa


class AttentionRoute:
    """Where a model's attention (and activation) is looked up, and what a paged step puts there."""

    def __init__(
        self,
        model: Any,
        prefix_attention: PrefixAttention = shared_prefix_attention,
        attend: SegmentAttention = segment_attention,
    ) -> None:
        self.module = sys.modules.get(type(model).__module__)
        self.original: Attention | None = getattr(self.module, "scaled_dot_product_attention", None)
        self.paged = (
            None
            if self.original is None
            else paged_attention(self.original, prefix_attention, attend)
        )
        self.swiglu = getattr(self.module, "swiglu", None)
        if not is_mlx_lm_swiglu(self.swiglu):
            self.swiglu = None  # only mlx-lm's own is stood in for
        self.ropes = plain_ropes(model)  # attention modules holding a plain nn.RoPE

    @contextmanager
    def active(self) -> Iterator[None]:
        """The paged attention (and fast swiglu and rope) in place for the body of the
        with-statement."""
        swaps = []
        if self.paged is not None:  # else an architecture without the seam: attention as it is
            swaps.append(("scaled_dot_product_attention", self.paged, self.original))
        if self.swiglu is not None and FAST_SWIGLU:
            swaps.append(("swiglu", step_swiglu, self.swiglu))
        for name, new, _ in swaps:
            setattr(self.module, name, new)
        ropes = self.ropes if STEP_ROPE else []
        tables: dict = {}
        for m in ropes:
            m["rope"] = StepRoPE(m["rope"], tables)  # (an nn.Module is a dict of its children)
        try:
            yield
        finally:
            for m in ropes:
                m["rope"] = m["rope"].rope
            for name, _, old in swaps:
                setattr(self.module, name, old)
