"""Attention of a paged step computed on the host CPU in numpy: the CPU backend's kernel.

On MLX's Linux CPU backend every elementwise pass of a softmax is slow: exp runs scalar libm at
~11 ns per score element, and even an add or a max costs 1-2 ns, where numpy's vectorised
kernels take ~0.2-0.6 ns (measured side by side on 16M floats: exp 11.3 vs 0.56 ns, add 2.1 vs
0.44 ns). Attention is the one part of a step made of such passes over large score blocks, so
here it leaves MLX: the queries, keys and values are evaluated (the layer's projections run
first), read as zero-copy numpy views, attended tile by tile (score blocks stay in cache, keys
no query of a tile can see are skipped) with the matmuls on numpy's BLAS, and the output comes
back as one MLX array. Per layer of a 1,000-token prompt: 8.6 ms against 32 ms for the same
tiles in MLX ops.

The functions mirror `attention.chunked_attention` and `attention.cascade_attention` (same
arguments and results to float32 rounding) and run only on the CPU: on Metal or CUDA the
evaluation barrier would cost far more than the kernels it replaces.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from batchmlx.engine.host.backend import HostBackend, current
from batchmlx.engine.host.elementwise import softcap as cap_scores
from batchmlx.engine.host.onednn import OneDNN
from batchmlx.engine.kv.paged import KEY_GROUP, additive_bias

# Query rows per tile (a tile's products always have rep x TILE_QUERIES rows, padded: see
# _attend_tiles), the KV block size: a chunk behind a cached prefix starts at a multiple of
# the block, so at a tile's start, its rows where a whole prompt's run puts them. With 64 its
# ~28 queries cost two padded tiles, 128 rows: 64 chats behind a ~900-token system prompt,
# whole process 8.7 -> 7.7 s with 16, 64 unique chats 9.6 / 9.5 s either way (a 934-token
# prompt alone pays for more tiles: its prefill 0.61 -> ~0.75 s). 3 query heads x 16 queries
# x 1,000 keys x 4 B ~ 0.2 MB of scores.
TILE_QUERIES = 16
# Below this many score elements per layer (batch x query heads x queries x keys) a call keeps
# MLX's attention: leaving MLX costs an evaluation barrier per layer and two copies. A prompt
# chunk wins that back from this size on, one-query rows (decodes) from half as many (measured:
# width-64 decode steps over ~150 keys 128 -> 120 ms, over a 944-key shared system prompt
# 170 -> 140 ms; width 256 over ~100 keys the same either side).
MIN_HOST_SCORES = 1 << 17
MIN_HOST_DECODE_SCORES = 1 << 16


def pays(queries: mx.array, keys_per_query: int) -> bool:
    """Whether host attention beats MLX's for this call (MIN_HOST_SCORES for prompt chunks,
    MIN_HOST_DECODE_SCORES for one query per sequence)."""
    b, hq, ql, _ = queries.shape
    least = MIN_HOST_SCORES if ql > 1 else MIN_HOST_DECODE_SCORES
    return b * hq * ql * keys_per_query >= least


def _host(x: mx.array) -> np.ndarray:
    """x as float32 numpy (evaluates it; zero-copy when it already is float32)."""
    return np.asarray(x if x.dtype == mx.float32 else x.astype(mx.float32))


def _bias(mask: mx.array | str | None, ql: int, kl: int) -> tuple[np.ndarray | None, bool]:
    """(additive float32 bias [B or 1, 1, Q, K] or None, whether the mask was "causal")."""
    if mask is None:
        return None, False
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        allowed = np.arange(kl)[None, :] <= (np.arange(ql) + (kl - ql))[:, None]
        return np.where(allowed, np.float32(0), np.float32(-np.inf))[None, None], True
    return _host(additive_bias(mask) if mask.dtype == mx.bool_ else mask), False


def _keys_seen(kl: int, causal_offset: int | None, q1: int) -> int:
    """Keys a tile ending at query q1 can see (all of them without a causal offset)."""
    if causal_offset is None:
        return kl
    return min(kl, max(1, causal_offset + q1))


def _attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    bias: np.ndarray | None,
    causal_offset: int | None,
    tile: int,
    prefix: tuple[np.ndarray, np.ndarray] | None = None,
    valid: np.ndarray | None = None,
    backend: HostBackend | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """`_attend_tiles` split over this thread and the workers: a prompt's query tiles (the
    later, larger ones first), a lone sequence's single tile by KV heads, or a single tile's
    sequences in two halves. valid [B, Q]: which
    queries are real (padded chunks); None: all. softcap: scores -> softcap * tanh(scores /
    softcap) before the mask (gemma2)."""
    b, h, rep, ql, d = q.shape
    out = np.empty_like(q)
    backend = backend or current()
    pool = backend.pool()
    if ql > tile:
        # the tiles (the later, larger ones first) taken one at a time by this thread and
        # pool_threads - 1 workers. Not every tile a pool job with this thread waiting: that
        # started the pool's second thread, and with two idle ones there, every later decode
        # step ran 5-10% slower (width 64: 57.4-58.5 -> 61.0-64.8 ms; the two then woke by
        # turns, onto the CPU of the GEMM pool's spinning worker)
        starts = iter(_tile_starts(ql, causal_offset, tile)[::-1])
        taking = threading.Lock()

        def drain() -> None:
            while True:
                with taking:
                    q0 = next(starts, None)
                if q0 is None:
                    return
                _attend_tiles(q, k, v, bias, causal_offset, tile, prefix, out, q0,
                              _tile_end(q0, ql, causal_offset, tile), None, softcap)  # fmt: skip

        jobs = [pool.submit(drain) for _ in range(backend.pool_threads - 1)]
        drain()
    elif b == 1 and h > 1 and prefix is None and backend.pool_threads > 1:
        # one sequence's one tile (a prompt's short chunk behind its cached prefix): its KV
        # heads in two halves, one on a worker, one here. Each head's products and softmax are
        # the same calls either way (numpy's matmul runs one BLAS call per head), so the bits
        # are too; alone on this thread, the 64 short chunks behind a cached ~900-token prefix
        # took 4.2 s of prefill, split 3.2 s
        mid = (h + 1) // 2

        def heads(h0: int, h1: int) -> tuple:
            return (q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], bias, causal_offset, tile, None,
                    out[:, h0:h1], 0, ql, valid, softcap)  # fmt: skip

        jobs = [pool.submit(_attend_tiles, *heads(mid, h))]
        _attend_tiles(*heads(0, mid))
    else:
        # the sequences in two halves: one on a worker, one here (a decode step's attention is
        # ~1 ms a layer; a second hand-off each way was a fifth of it)
        half = (b + 1) // 2 if backend.pool_threads > 1 and b > 1 else b

        def rows(r0: int, r1: int) -> tuple:
            return (q[r0:r1], k[r0:r1], v[r0:r1],
                    None if bias is None else bias[r0:r1] if bias.shape[0] > 1 else bias,
                    causal_offset, tile, prefix, out[r0:r1], 0, ql,
                    None if valid is None else valid[r0:r1], softcap)  # fmt: skip

        jobs = [pool.submit(_attend_tiles, *rows(half, b))] if half < b else []
        _attend_tiles(*rows(0, half))
    for job in jobs:
        job.result()
    return out


def _tile_starts(ql: int, causal_offset: int | None, tile: int) -> list[int]:
    """The first query of each tile: tiles end at multiples of `tile` in the sequence's own
    positions (its causal offset counted), so a query falls in the same tile whether its
    chunk began at the prompt's start or after a prefix-cache hit."""
    return [0, *range(_tile_end(0, ql, causal_offset, tile), ql, tile)]


def _tile_end(q0: int, ql: int, causal_offset: int | None, tile: int) -> int:
    """The end of the tile that starts at query q0 (see `_tile_starts`)."""
    at = (causal_offset or 0) + q0
    return min(ql, q0 + tile - at % tile)


def _attend_tiles(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    bias: np.ndarray | None,
    causal_offset: int | None,
    tile: int,
    prefix: tuple[np.ndarray, np.ndarray] | None,
    out: np.ndarray,
    first: int,
    last: int,
    valid: np.ndarray | None = None,
    softcap: float | None = None,
) -> None:
    """softmax(q k^T + bias) v over [the shared prefix keys, if any] + each sequence's keys,
    for queries first..last, into out. valid [B, Q] (one tile only): the prefix part scores
    the real queries only, not the padding of a batch of chunks (most of the work there: a
    900-token prefix against chunks of ~20 tokens padded to 32).

    q [B, H, rep, Q, D] already scaled; k, v [B, H, K, D]; bias [B or 1, 1, Q, K]; prefix
    (keys, values) [H, P, D] seen whole by every query. One max per row over both parts, so the
    two partial softmaxes add without rescaling. out [B, H, rep, Q, D]."""
    b, h, rep, _, d = q.shape
    kl = k.shape[2]
    q0 = first
    while q0 < last:
        q1 = min(last, _tile_end(q0, q.shape[3], causal_offset, tile))
        t = q1 - q0
        kc = _keys_seen(kl, causal_offset, q1)
        # the products over a whole tile's rows whatever its real ones (a cache hit's last
        # queries, a prompt's first tile): a BLAS product's row depends on the rows around
        # it, so a query's scores are the same bits in a chunk of any length
        qc = q[:, :, :, q0:q1].reshape(b, h, rep * t, d)  # the real rows (the prefix's part)
        kt, vt = (k, v) if kc == kl else (k[:, :, :kc], v[:, :, :kc])
        s = np.matmul(_whole_tile(qc, rep, tile), kt.swapaxes(-1, -2))
        if t < tile:
            s = s.reshape(b, h, rep, tile, kc)[:, :, :, :t]
            s = np.ascontiguousarray(s).reshape(b, h, rep * t, kc)  # [B, H, rep*t, kc]
        if softcap is not None:
            cap_scores(s, softcap)
        if bias is not None:
            s.reshape(b, h, rep, t, kc)[...] += bias[:, :, None, q0:q1, :kc]
        m = s.max(axis=-1, keepdims=True)
        part = None
        sel: slice | np.ndarray = slice(None)  # the rows of qp that the prefix part scores
        if prefix is not None:  # every sequence's queries against one copy of the prefix
            qp = qc.transpose(1, 0, 2, 3).reshape(h, b * rep * t, d)
            if valid is not None:  # the real queries' rows of qp (order: sequence, rep, query)
                keep = np.broadcast_to(valid[:, None, q0:q1], (b, rep, t)).reshape(-1)
                sel = np.flatnonzero(keep)
                qp = qp[:, sel]
            flat = m.transpose(1, 0, 2, 3).reshape(h, b * rep * t)  # a copy: [H, B*rep*t]
            row_max = np.ascontiguousarray(flat[:, sel])
            part = prefix_part(qp, prefix, row_max, softcap=softcap)
            flat[:, sel] = row_max
            m = flat.reshape(h, b, rep * t, 1).transpose(1, 0, 2, 3)
        np.subtract(s, m, out=s)
        np.exp(s, out=s)
        total = s.sum(axis=-1, keepdims=True)
        o = np.matmul(_whole_tile(s, rep, tile), vt)  # [B, H, rep*tile, D]
        if t < tile:
            o = o.reshape(b, h, rep, tile, d)[:, :, :, :t]
            o = np.ascontiguousarray(o).reshape(b, h, rep * t, d)  # [B, H, rep*t, D]
        if part is not None:
            tf = total.transpose(1, 0, 2, 3).reshape(h, b * rep * t)
            tf[:, sel] += part[0]
            of = o.transpose(1, 0, 2, 3).reshape(h, b * rep * t, d)
            of[:, sel] += part[1]
            total = tf.reshape(h, b, rep * t, 1).transpose(1, 0, 2, 3)
            o = of.reshape(h, b, rep * t, d).transpose(1, 0, 2, 3)
        o /= total
        out[:, :, :, q0:q1] = o.reshape(b, h, rep, t, d)
        q0 = q1


def _whole_tile(x: np.ndarray, rep: int, tile: int) -> np.ndarray:
    """x [B, H, rep*t, N] as [B, H, rep*tile, N]: each query head's t rows followed by zero
    rows up to `tile` (x itself when t == tile), for the products of `_attend_tiles`."""
    b, h, rows, n = x.shape
    t = rows // rep
    if t == tile:
        return x
    whole = np.zeros((b, h, rep, tile, n), np.float32)
    whole[:, :, :, :t] = x.reshape(b, h, rep, t, n)
    return whole.reshape(b, h, rep * tile, n)


def host_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | str | None,
    *,
    causal_offset: int | None = None,
    chunk: int | None = None,
    backend: HostBackend | None = None,
) -> mx.array:
    """`attention.chunked_attention` in numpy: queries [B, Hq, Q, D]; keys, values
    [B, H, K, D] (query head h*rep + r reads kv head h); mask [B or 1, 1, Q, K] bool or additive,
    "causal" or None; query i sees no key past causal_offset + i. Returns [B, Hq, Q, D]."""
    b, hq, ql, d = queries.shape
    h, kl = keys.shape[1], keys.shape[2]
    mx.eval(queries, keys, values, *([mask] if isinstance(mask, mx.array) else []))
    bias, causal = _bias(mask, ql, kl)
    if causal and causal_offset is None:
        causal_offset = kl - ql
    q = (_host(queries) * np.float32(scale)).reshape(b, h, hq // h, ql, d)
    out = _attend(q, _host(keys), _host(values), bias, causal_offset, chunk or TILE_QUERIES,
                  backend=backend)  # fmt: skip
    return mx.array(out.reshape(b, hq, ql, d)).astype(queries.dtype)


def host_cascade_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    prefix: tuple[mx.array, mx.array],
    scale: float,
    mask: mx.array,
    *,
    causal_offset: int | None = None,
    real_rows: mx.array | None = None,
    backend: HostBackend | None = None,
) -> mx.array:
    """`attention.cascade_attention` in numpy: attention over a prefix every sequence shares
    (prefix keys, values [H, P, D], read once for the whole batch) + each sequence's own keys
    [B, H, Ks, D] under mask [B, 1, Q, Ks]. real_rows: indices b * Q + i of the real queries
    of padded chunks (the others' outputs are not computed in full: they are dropped)."""
    b, hq, ql, d = queries.shape
    h = keys.shape[1]
    mx.eval(queries, keys, values, prefix, mask)
    bias, _ = _bias(mask, ql, keys.shape[2])
    q = (_host(queries) * np.float32(scale)).reshape(b, h, hq // h, ql, d)
    shared = (_host(prefix[0]), _host(prefix[1]))
    valid = None
    if real_rows is not None and ql <= TILE_QUERIES:
        valid = np.zeros(b * ql, dtype=bool)
        valid[np.asarray(real_rows)] = True
        valid = valid.reshape(b, ql)
    out = _attend(q, _host(keys), _host(values), bias, causal_offset, TILE_QUERIES, shared,
                  valid, backend)  # fmt: skip
    return mx.array(out.reshape(b, hq, ql, d)).astype(queries.dtype)


# Decode attention splits its sequences over the workers from this many score elements on
# (sequences x query heads x keys): below it the hand-off costs more than the second core
# saves (measured: width 8 over 64 keys 0.04 ms alone, 0.08 split; width 64 over 128 keys
# 0.53 alone, 0.49 split)
MIN_SPLIT_DECODE_SCORES = 1 << 16


def decode_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    bias: np.ndarray,
    prefix: tuple[np.ndarray, np.ndarray] | None = None,
    backend: HostBackend | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """One query per sequence (decode rows) in numpy: q [S, H, rep, D] already scaled; k, v
    [S, H, L, D]; bias [S, 1, 1, L] additive; prefix (keys, values) [H, P, D] every sequence
    also sees. Returns [S, H, rep, D]. The lean form of `_attend_tiles` for a single query:
    a width-8 decode layer costs half as much."""
    s, h, rep, _ = q.shape
    backend = backend or current()
    lib = backend.attention_onednn()
    if lib is not None:
        backend.pool()  # (numpy's BLAS single-threaded first: the scores' calls are numpy's)
        return _decode_rows(q, k, v, bias, prefix, lib, softcap)
    if s > 1 and backend.pool_threads > 1 and s * h * rep * k.shape[2] >= MIN_SPLIT_DECODE_SCORES:
        out = np.empty(q.shape, np.float32)
        half = (s + 1) // 2
        pool = backend.pool()

        def part(a: int, b: int) -> None:
            out[a:b] = _decode_rows(q[a:b], k[a:b], v[a:b], bias[a:b] if bias.shape[0] > 1
                                    else bias, prefix, None, softcap)  # fmt: skip

        job = pool.submit(part, half, s)
        part(0, half)
        job.result()
        return out
    return _decode_rows(q, k, v, bias, prefix, None, softcap)


def _decode_rows(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    bias: np.ndarray,
    prefix: tuple[np.ndarray, np.ndarray] | None,
    lib: OneDNN | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """lib: oneDNN, which runs the probabilities-times-values product over all S x H
    (sequence, KV head) pairs as one batched primitive on its own threads (numpy: one small
    BLAS call per pair). The scores stay numpy's: over the keys read transposed oneDNN's
    batched product took twice as long as numpy's per-pair calls (30 layers at width 64 over
    192 keys: 32.8-42.8 ms against 15.4-17.8, a 2-core Zen 4, 2026-12-02; a width-64 run of
    128 tokens 23.9 -> 20.8 s, medians of 4)."""
    s, h, rep, d = q.shape
    kl = k.shape[2]
    sc = _scores(q, k)  # [S, H, rep, L]
    if softcap is not None:
        cap_scores(sc, softcap)
    sc += bias
    m = sc.max(axis=-1, keepdims=True)
    part = None
    if prefix is not None:  # every row's queries against the one copy of the prefix
        qp = q.transpose(1, 0, 2, 3).reshape(h, s * rep, d)
        row_max = np.ascontiguousarray(m.reshape(s, h, rep).transpose(1, 0, 2)).reshape(h, -1)
        part = prefix_part(qp, prefix, row_max, lib, softcap)
        m = row_max.reshape(h, s, rep).transpose(1, 0, 2)[..., None]
    sc -= m
    np.exp(sc, out=sc)
    total = _key_sums(sc)
    if lib is None:
        o = np.matmul(sc, v)  # [S, H, rep, D]
    else:
        o = np.empty((s, h, rep, d), np.float32)
        lib.bmm(sc.reshape(s * h, rep, kl), v.reshape(s * h, kl, d), o.reshape(s * h, rep, d))
    if part is not None:
        total += part[0].reshape(h, s, rep).transpose(1, 0, 2)[..., None]
        o += part[1].reshape(h, s, rep, d).transpose(1, 0, 2, 3)
    o /= total
    return o


def _scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q [S, H, rep, D] . k [S, H, L, D]^T -> [S, H, rep, L], KEY_GROUP keys per BLAS call
    when L is a multiple of it (the engine pads keys so: kv/paged.key_room): every call the
    same shape, so a row's scores are the same bits at any L, i.e. beside any longer
    sequence (one call over all L took another kernel at another L). The same time as one
    call per row (0.31 against 0.30 ms at width 64 over 160 keys)."""
    s, h, rep, d = q.shape
    kl = k.shape[2]
    out = np.empty((s, h, rep, kl), np.float32)
    if kl % KEY_GROUP:
        return np.matmul(q, k.swapaxes(-1, -2), out=out)
    groups = kl // KEY_GROUP
    np.matmul(q[:, :, None], k.reshape(s, h, groups, KEY_GROUP, d).swapaxes(-1, -2),
              out=out.reshape(s, h, rep, groups, KEY_GROUP).transpose(0, 1, 3, 2, 4))  # fmt: skip
    return out


def _key_sums(p: np.ndarray) -> np.ndarray:
    """p [..., L] summed over L, keepdims: each KEY_GROUP keys summed alone (einsum's loop over
    a fixed length: as fast as one sum over L, where numpy's per-group sums took 2.8x), then
    the groups one after another (a cumulative sum is sequential), so masked keys past a
    row's own (zeros) leave its sum's bits as they are; numpy's pairwise sum over all L splits
    it where L falls."""
    kl = p.shape[-1]
    if kl % KEY_GROUP:
        return p.sum(axis=-1, keepdims=True)
    parts = np.einsum("...k->...", p.reshape(*p.shape[:-1], kl // KEY_GROUP, KEY_GROUP))
    return np.cumsum(parts, axis=-1)[..., -1:]


# A prefix part's scores are made this many elements at a time ([H, rows, P], 4 MB; one row
# a head when the prefix is longer), in a buffer each thread keeps: the whole [H, R, P] block
# behind a 900-token prefix was 26 MB per thread and layer for a step of 63 chunks, taken fresh
# (page faults) and out of cache for every pass over it
PREFIX_BLOCK_ELEMENTS = 1 << 20
_scratch = threading.local()


def prefix_part(
    qp: np.ndarray,
    prefix: tuple[np.ndarray, np.ndarray],
    row_max: np.ndarray,
    lib: OneDNN | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Queries qp [H, R, D] against a prefix's keys and values [H, P, D] every one of them
    sees: row_max [H, R] (contiguous) holds each row's max over its own keys and is raised in
    place to the max over both parts, so the two partial softmaxes add without rescaling.
    Returns (sums [H, R], outputs [H, R, D]) of exp(score - row_max) over the prefix. lib:
    oneDNN for the two products (its threads; the caller's thread holds no other work), else
    numpy's BLAS (one thread: the callers split rows over the workers)."""
    h, r, d = qp.shape
    keys, values = prefix
    p = keys.shape[1]
    kt = keys.swapaxes(-1, -2)
    rows = max(1, min(r, PREFIX_BLOCK_ELEMENTS // (h * p)))
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < h * rows * p:
        buf = _scratch.buf = np.empty(h * rows * p, np.float32)
    product = lib.bmm if lib is not None else lambda a, b, o: np.matmul(a, b, out=o)
    sums = np.empty((h, r), np.float32)
    out = np.empty((h, r, d), np.float32)
    for r0 in range(0, r, rows):
        r1 = min(r, r0 + rows)
        sc = buf[: h * (r1 - r0) * p].reshape(h, r1 - r0, p)
        product(qp[:, r0:r1], kt, sc)
        if softcap is not None:
            cap_scores(sc, softcap)
        top = row_max[:, r0:r1]
        np.maximum(top, sc.max(axis=-1), out=top)
        sc -= top[..., None]
        np.exp(sc, out=sc)
        np.sum(sc, axis=-1, out=sums[:, r0:r1])
        product(sc, values, out[:, r0:r1])
    return sums, out
