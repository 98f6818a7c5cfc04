"""The sampler over one step's logits: numpy over the host buffer on the CPU, MLX elsewhere."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchmlx.core.request import SamplingParams
from batchmlx.engine import sampler
from batchmlx.engine.sampler import SampleRow, sample


@pytest.mark.parametrize("host", [True, False], ids=["numpy", "mlx"])
def test_greedy_rows_take_the_first_argmax_and_only_askers_get_logprobs(host, monkeypatch):
    monkeypatch.setattr(sampler, "on_host", lambda: host)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 300)).astype(np.float32) * 3
    logits[1, [7, 9]] = 50.0  # a tie: the first index wins
    rows = [
        SampleRow(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), 0, 1),
        SampleRow(SamplingParams(temperature=0.0), 0, 2),
        SampleRow(SamplingParams(temperature=0.0, logprobs=True), 0, 3),
        SampleRow(SamplingParams(temperature=0.7, seed=5, logprobs=True), 4, 4),
    ]
    tokens, lps = sample(mx.array(logits).astype(mx.bfloat16).astype(mx.float32), rows)
    x = np.array(mx.array(logits).astype(mx.bfloat16).astype(mx.float32))
    assert tokens[:3] == [int(x[0].argmax()), 7, int(x[2].argmax())]
    want = (
        x
        - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - x.max(-1, keepdims=True)
    )
    assert lps[1] is None
    for i in (0, 2, 3):
        assert lps[i].token_id == tokens[i]
        assert lps[i].logprob == pytest.approx(float(want[i, tokens[i]]), abs=1e-5)
    top = lps[0].top
    assert [t for t, _ in top] == list(np.argsort(-x[0], kind="stable")[:3])
    assert all(a >= b for (_, a), (_, b) in zip(top, top[1:], strict=False))


def test_both_paths_sample_the_same_tokens_and_logprobs(monkeypatch):
    """The numpy path is the MLX one computed elsewhere: same tokens (greedy and seeded)
    and logprobs within float32 rounding."""
    rng = np.random.default_rng(1)
    logits = mx.array(rng.standard_normal((6, 500)).astype(np.float32) * 4)
    rows = [SampleRow(SamplingParams(temperature=t, seed=i, logprobs=True, top_logprobs=2), i, i)
            for i, t in enumerate([0.0, 0.0, 0.5, 1.0, 0.0, 1.3])]  # fmt: skip
    out = {}
    for host in (True, False):
        monkeypatch.setattr(sampler, "on_host", lambda h=host: h)
        out[host] = sample(logits, rows)
    assert out[True][0] == out[False][0]
    for a, b in zip(out[True][1], out[False][1], strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
