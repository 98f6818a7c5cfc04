"""chunked_attention (tiles of queries, polynomial exp, skipped masked keys) equals plain
attention, and the engine's tokens do not change with it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchmlx.engine.host.attention import host_attention
from batchmlx.engine.kernels import attention
from batchmlx.engine.kernels.attention import chunked_attention, exp_nonpositive
from batchmlx.engine.kv.paged import BatchLayout
from tests.engine.helpers import naive


def test_exp_matches_exact_exp_to_float32_precision() -> None:
    x = mx.concatenate([-mx.abs(mx.random.normal((10_000,), key=mx.random.key(1))) * 30,
                        mx.array([0.0, -1e-8, -87.0, -100.0])])  # fmt: skip
    got, want = np.array(exp_nonpositive(x)), np.exp(np.array(x).astype(np.float64))
    # x * log2(e) rounds to float32 first: relative error ~|x| * 2**-24, as for any float32 exp
    np.testing.assert_allclose(got, want, rtol=5e-6, atol=1e-37)
    small = np.abs(np.array(x)) < 1
    np.testing.assert_allclose(got[small], want[small], rtol=5e-7)
    assert float(exp_nonpositive(mx.array([-mx.inf])).item()) < 1e-37  # masked: ~0


@pytest.mark.parametrize(
    ("q_len", "rep", "chunk"), [(1, 3, 64), (37, 3, 8), (50, 1, 16), (9, 2, 64)]
)
def test_chunked_equals_naive_attention_on_a_ragged_paged_layout(q_len, rep, chunk) -> None:
    # three sequences: a prompt from 0, a chunk continuing at 20, a shorter one (padding rows)
    lens, starts = [q_len, q_len, max(1, q_len // 2)], [0, 20, 5]
    lay = BatchLayout.build(
        block_size=4, n_kv_heads=2, token_chunks=[[1] * n for n in lens], starts=starts,
        block_tables=[list(range(1 + 10 * i, 11 + 10 * i)) + [0] * 10 for i in range(3)],
    )  # fmt: skip
    b, kl = 3, lay.mask.shape[-1]
    keys = mx.random.split(mx.random.key(7), 3)
    q = mx.random.normal((b, 2 * rep, q_len, 16), key=keys[0])
    k, v = (mx.random.normal((b, 2, kl, 16), key=kk) for kk in keys[1:])
    want = naive(q, k, v, 0.25, lay.mask)
    for mask in (lay.mask, lay.bias):
        got = chunked_attention(q, k, v, 0.25, mask, causal_offset=lay.causal_offset, chunk=chunk)
        np.testing.assert_allclose(np.array(got), want, atol=2e-6, rtol=1e-5)
    whole = chunked_attention(q, k, v, 0.25, lay.mask, chunk=chunk)  # no skipping: same
    np.testing.assert_allclose(np.array(whole), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kernel", [chunked_attention, host_attention])
def test_causal_string_and_half_precision_inputs(kernel) -> None:
    """Both tile kernels: MLX ops and numpy on the host."""
    keys = mx.random.split(mx.random.key(3), 3)
    q = mx.random.normal((1, 4, 70, 32), key=keys[0])
    k, v = (mx.random.normal((1, 2, 90, 32), key=kk) for kk in keys[1:])
    causal = (np.arange(90)[None, :] <= np.arange(70)[:, None] + 20)[None, None]
    want = naive(q, k, v, 0.2, causal)
    np.testing.assert_allclose(np.array(kernel(q, k, v, 0.2, "causal")), want, atol=2e-6, rtol=1e-5)
    half = kernel(*(x.astype(mx.bfloat16) for x in (q, k, v)), 0.2, "causal")
    assert half.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(half.astype(mx.float32)), want, atol=3e-2)
    with pytest.raises(ValueError, match="unknown attention mask"):
        kernel(q, k, v, 0.2, "sliding")


def test_engine_tokens_and_logprobs_same_with_either_attention(tiny_model, monkeypatch) -> None:
    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.core.request import GenerationRequest, SamplingParams
    from batchmlx.engine.runners.paged import paged_engine

    class Tok:
        def decode(self, ids):
            return ""

    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((150, 3, 40, 90))]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)

    def run():
        eng = paged_engine(tiny_model, Tok(), context_length=512,
                     config=EngineSettings(max_batch_size=4, max_prefill_tokens=128))  # fmt: skip
        reqs = [GenerationRequest(request_id=f"r{i}", prompt_tokens=p, params=params)
                for i, p in enumerate(prompts)]  # fmt: skip
        return eng.generate(reqs)

    fast = run()
    monkeypatch.setattr(attention, "FAST_ATTENTION", False)
    old = run()
    assert [o.token_ids for o in fast] == [o.token_ids for o in old]
    for a, b in zip(fast, old, strict=True):
        np.testing.assert_allclose([x.logprob for x in a.logprobs],
                                   [x.logprob for x in b.logprobs], atol=1e-4)  # fmt: skip
