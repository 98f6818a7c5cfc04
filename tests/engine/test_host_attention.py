"""Host attention (numpy tiles on the CPU, split over threads) equals plain attention, is chosen
only where it pays, and leaves the engine's tokens and log-probs as they were."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchmlx.engine.host import attention as host_attention
from batchmlx.engine.host.attention import host_attention as host
from batchmlx.engine.host.attention import host_cascade_attention
from batchmlx.engine.host.backend import current
from batchmlx.engine.kernels import attention
from batchmlx.engine.kv import paged as kv_cache
from batchmlx.engine.kv.paged import BatchLayout
from tests.engine.helpers import naive


def ragged(q_len: int, rep: int, b: int = 3):
    """A ragged paged step: a prompt from 0, a chunk continuing at 20, a shorter one (padded)."""
    lens = [q_len, q_len, max(1, q_len // 2)][:b]
    lay = BatchLayout.build(
        block_size=4, n_kv_heads=2, token_chunks=[[1] * n for n in lens], starts=[0, 20, 5][:b],
        block_tables=[list(range(1 + 60 * i, 61 + 60 * i)) for i in range(b)],
    )  # fmt: skip
    keys = mx.random.split(mx.random.key(q_len * 10 + rep), 3)
    kl = lay.mask.shape[-1]
    q = mx.random.normal((b, 2 * rep, q_len, 16), key=keys[0])
    k, v = (mx.random.normal((b, 2, kl, 16), key=kk) for kk in keys[1:])
    return lay, q, k, v


@pytest.mark.parametrize(
    ("q_len", "rep", "chunk"), [(1, 3, 64), (37, 3, 8), (50, 1, 16), (9, 2, 64), (150, 3, None)]
)
def test_host_equals_naive_attention_on_a_ragged_paged_layout(q_len, rep, chunk) -> None:
    # several tiles go to the threads tile by tile; one tile splits its sequences in two
    lay, q, k, v = ragged(q_len, rep)
    want = naive(q, k, v, 0.25, lay.mask)
    for mask in (lay.mask, lay.bias):
        got = host(q, k, v, 0.25, mask, causal_offset=lay.causal_offset, chunk=chunk)
        np.testing.assert_allclose(np.array(got), want, atol=2e-6, rtol=1e-5)
    whole = host(q, k, v, 0.25, lay.bias, chunk=chunk)  # no keys skipped: same
    np.testing.assert_allclose(np.array(whole), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("block_rows", [None, 5], ids=["one-block", "prefix-in-blocks"])
@pytest.mark.parametrize(
    ("q_len", "rep", "b"), [(1, 3, 5), (4, 1, 4), (5, 3, 3), (70, 3, 2), (1, 2, 1)]
)
def test_host_cascade_equals_attention_over_concatenated_keys(
    q_len, rep, b, block_rows, monkeypatch
) -> None:
    mx.random.seed(q_len + b)
    h, d, kp, ks = 2, 16, 32, q_len + 9
    if block_rows:  # the prefix's scores made 5 query rows at a time (a partial last block)
        monkeypatch.setattr(host_attention, "PREFIX_BLOCK_ELEMENTS", block_rows * h * kp)
    q = mx.random.normal((b, h * rep, q_len, d))
    prefix = (mx.random.normal((h, kp, d)), mx.random.normal((h, kp, d)))
    suf_k, suf_v = mx.random.normal((b, h, ks, d)), mx.random.normal((b, h, ks, d))
    valid = np.arange(ks)[None, :] < (ks - np.arange(b))[:, None]
    qpos = (ks - np.arange(b))[:, None] - q_len + np.arange(q_len)[None, :]
    mask = (np.arange(ks)[None, None, :] <= qpos[:, :, None]) & valid[:, None, :]
    full_k = np.concatenate([np.broadcast_to(np.array(prefix[0])[None], (b, h, kp, d)),
                             np.array(suf_k)], axis=2)  # fmt: skip
    full_v = np.concatenate([np.broadcast_to(np.array(prefix[1])[None], (b, h, kp, d)),
                             np.array(suf_v)], axis=2)  # fmt: skip
    full_mask = np.concatenate([np.ones((b, q_len, kp), bool), mask], axis=2)[:, None]
    want = naive(q, full_k, full_v, 0.25, full_mask)
    bias = mx.array(np.where(mask, 0.0, -np.inf).astype(np.float32)[:, None])
    for offset in (None, ks - q_len):  # the last row's start: keys past it skipped per tile
        got = host_cascade_attention(q, suf_k, suf_v, prefix, 0.25, bias, causal_offset=offset)
        np.testing.assert_allclose(np.array(got), want, atol=2e-6, rtol=1e-5)
    if q_len > 1:  # padded chunks: only the real queries' outputs count (the rest are dropped)
        real = np.flatnonzero((np.arange(b)[:, None] + np.arange(q_len)[None, :]) % 3 != 1)
        got = host_cascade_attention(q, suf_k, suf_v, prefix, 0.25, bias,
                                     real_rows=mx.array(real.astype(np.int32)))  # fmt: skip
        rows = np.array(got).transpose(0, 2, 1, 3).reshape(b * q_len, -1)[real]
        np.testing.assert_allclose(rows, want.transpose(0, 2, 1, 3).reshape(b * q_len, -1)[real],
                                   atol=2e-6, rtol=1e-5)  # fmt: skip


def test_the_route_leaves_mlx_only_where_the_scores_pay(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(attention, "HOST_ATTENTION", True)
    monkeypatch.setattr(attention, "host_attention", lambda *a, **kw: calls.append("host"))
    monkeypatch.setattr(attention, "chunked_attention", lambda *a, **kw: calls.append("mlx"))
    limit = host_attention.MIN_HOST_SCORES
    chunks = mx.zeros((8, 4, 2, 16))  # 8 sequences x 4 query heads x 2 queries ...
    attention.tiled_attention(chunks, mx.zeros((8, 2, limit // 64 - 1, 16)), None, 1.0, None)
    attention.tiled_attention(chunks, mx.zeros((8, 2, limit // 64, 16)), None, 1.0, None)
    decode = mx.zeros((16, 4, 1, 16))  # one query per sequence: its own limit
    rows = host_attention.MIN_HOST_DECODE_SCORES // 64
    attention.tiled_attention(decode, mx.zeros((16, 2, rows - 1, 16)), None, 1.0, None)
    attention.tiled_attention(decode, mx.zeros((16, 2, rows, 16)), None, 1.0, None)
    big = mx.zeros((8, 2, limit // 64, 16))
    monkeypatch.setattr(attention, "HOST_ATTENTION", False)  # never, whatever the size
    attention.tiled_attention(chunks, big, None, 1.0, None)
    assert calls == ["mlx", "host", "mlx", "host", "mlx"]


def test_engine_tokens_and_logprobs_same_on_the_host(tiny_model, monkeypatch) -> None:
    """Every attention of a run on the host (threshold 0) against every one in MLX: prompts
    across several tiles, chunked prefill, decodes, a shared prefix, mixed steps."""
    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.core.request import GenerationRequest, SamplingParams
    from batchmlx.engine.runners.paged import paged_engine

    class Tok:
        def decode(self, ids):
            return ""

    system = [(5 * j) % 250 + 3 for j in range(48)]
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((150, 3, 40, 90))]
    prompts += [system + [i + 3, i + 4] for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)

    def run():
        eng = paged_engine(tiny_model, Tok(), context_length=512,
                     config=EngineSettings(max_batch_size=8, max_prefill_tokens=128))  # fmt: skip
        reqs = [GenerationRequest(request_id=f"r{i}", prompt_tokens=p, params=params)
                for i, p in enumerate(prompts)]  # fmt: skip
        return eng.generate(reqs)

    used: list[int] = []
    real = host_attention.host_cascade_attention
    monkeypatch.setattr(attention, "host_cascade_attention",
                        lambda *a, **kw: used.append(1) or real(*a, **kw))  # fmt: skip
    monkeypatch.setattr(attention, "HOST_ATTENTION", True)
    monkeypatch.setattr(host_attention, "MIN_HOST_SCORES", 0)
    monkeypatch.setattr(host_attention, "MIN_HOST_DECODE_SCORES", 0)
    monkeypatch.setattr(kv_cache, "MIN_CASCADE_BLOCKS", 1)  # the 3-block system prompt too
    on_host = run()
    assert used  # the shared prefix went through the host cascade
    monkeypatch.setattr(attention, "HOST_ATTENTION", False)
    in_mlx = run()
    assert [o.token_ids for o in on_host] == [o.token_ids for o in in_mlx]
    for a, b in zip(on_host, in_mlx, strict=True):
        np.testing.assert_allclose([x.logprob for x in a.logprobs],
                                   [x.logprob for x in b.logprobs], atol=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    "path",
    ["numpy", "numpy-split", pytest.param("onednn", marks=pytest.mark.skipif(
        not current().onednn_available(), reason="no oneDNN here"))],
)  # fmt: skip
@pytest.mark.parametrize(
    "with_prefix", [False, True, "in-blocks"], ids=["own-keys", "prefix", "prefix-in-blocks"]
)
def test_decode_attention_equals_naive_over_own_keys_and_a_shared_prefix(
    path, with_prefix, monkeypatch
) -> None:
    """The one-query kernel of host steps: S sequences with their own key lengths (the bias
    masks the rest), optionally behind a prefix every one of them sees (its scores made all
    at once or 4 query rows at a time); its products in numpy (alone or the sequences split
    over two threads) or as oneDNN batched matmuls."""
    split = path == "numpy-split"
    monkeypatch.setattr(host_attention, "MIN_SPLIT_DECODE_SCORES", 1 if split else 1 << 40)
    backend = current()  # the process's, as MLX's attention path finds it
    monkeypatch.setattr(backend, "pool_threads", 2)
    lib = backend.onednn() if path == "onednn" else None
    monkeypatch.setattr(backend, "_attention_onednn", lib)
    rng = np.random.default_rng(7)
    s, h, rep, d, kl, p = 5, 2, 3, 16, 12, 9
    if with_prefix == "in-blocks":  # 15 rows a head: blocks of 4, 4, 4, 3
        monkeypatch.setattr(host_attention, "PREFIX_BLOCK_ELEMENTS", 4 * h * p)
    q = rng.standard_normal((s, h, rep, d)).astype(np.float32) * 0.5
    k, v = (rng.standard_normal((s, h, kl, d)).astype(np.float32) for _ in range(2))
    lens = np.array([1, 4, 12, 7, 9])
    seen = np.arange(kl)[None, :] < lens[:, None]  # [S, K]
    bias = np.where(seen, 0, -np.inf).astype(np.float32)[:, None, None, :]
    prefix = None
    if with_prefix:  # the naive reference: the prefix's keys ahead of each sequence's own
        pk, pv = (rng.standard_normal((h, p, d)).astype(np.float32) for _ in range(2))
        prefix = (pk, pv)
        k_all = np.concatenate([np.broadcast_to(pk, (s, h, p, d)), k], axis=2)
        v_all = np.concatenate([np.broadcast_to(pv, (s, h, p, d)), v], axis=2)
        seen = np.concatenate([np.ones((s, p), bool), seen], axis=1)
    else:
        k_all, v_all = k, v
    got = host_attention.decode_attention(q, k, v, bias, prefix)  # q already scaled
    want = naive(q.reshape(s, h * rep, 1, d), k_all, v_all, 1.0, seen[:, None, None, :])
    np.testing.assert_allclose(got.reshape(s, h * rep, 1, d), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("h", "ql", "offset"), [(3, 6, 940), (2, 64, 0), (5, 1, 30)])
def test_one_sequences_tile_split_by_kv_heads_gives_the_unsplit_bits(
    h, ql, offset, monkeypatch
) -> None:
    """A lone sequence's single tile (a short chunk behind its cached prefix) goes to two
    threads by KV head: the very bits of the whole tile on one thread, and close to plain
    attention."""
    backend = current()
    monkeypatch.setattr(backend, "pool_threads", 2)
    rng = np.random.default_rng(h * 100 + ql)
    rep, d, tile = 3, 16, 64  # (one tile: ql <= tile)
    kl = offset + ql
    q = rng.standard_normal((1, h, rep, ql, d)).astype(np.float32) * 0.3
    k, v = (rng.standard_normal((1, h, kl, d)).astype(np.float32) for _ in range(2))
    bias = np.where(np.arange(kl)[None, :] <= np.arange(offset, kl)[:, None], 0,
                    -np.inf).astype(np.float32)[None, None]  # fmt: skip
    tiles = host_attention._attend_tiles
    calls: list[int] = []  # each call's KV heads

    def counted(*args, **kwargs):
        calls.append(args[0].shape[1])
        return tiles(*args, **kwargs)

    monkeypatch.setattr(host_attention, "_attend_tiles", counted)
    split = host_attention._attend(q, k, v, bias, offset, tile, backend=backend)
    assert sorted(calls) == sorted([(h + 1) // 2, h // 2])  # two calls, the heads between them
    whole = np.empty_like(q)
    tiles(q, k, v, bias, offset, tile, None, whole, 0, ql)
    assert np.array_equal(split, whole)
    want = naive(q.reshape(1, h * rep, ql, d), k, v, 1.0, np.isfinite(bias))
    np.testing.assert_allclose(split.reshape(1, h * rep, ql, d), want, rtol=1e-5, atol=1e-5)
