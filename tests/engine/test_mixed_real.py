"""Mixed, packed steps on the real default model: long and short prompts arriving at different
times give the greedy tokens of simple mode and of mlx-lm's own generation."""

from __future__ import annotations

import mlx.core as mx
import pytest

from batchmlx.core.request import GenerationRequest, SamplingParams
from tests.engine.test_engine_real import QUESTIONS, chat_ids, make_engine

pytestmark = pytest.mark.real_model

N = 10
STORY = (
    "The lighthouse keeper kept a log of every ship that passed the point, the weather at "
    "dawn and dusk, the state of the lamp and the oil, and the birds that nested on the rocks. "
)


def mlx_lm_greedy(loaded, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), loaded.model, max_tokens=n)
    return [int(tok) for tok, _ in steps]


def run_staggered(e, arrivals: list[tuple[int, GenerationRequest]]) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    pending = list(arrivals)
    n = 0
    while pending or e.has_unfinished():
        while pending and pending[0][0] <= n:
            e.add(pending.pop(0)[1])
        for o in e.step():
            outs[o.request_id] = o.token_ids
        n += 1
    return outs


def test_long_prompts_arriving_mid_decode_keep_greedy_tokens(default_model):
    tok = default_model.tokenizer
    params = SamplingParams(max_tokens=N, temperature=0.0)
    long_a = chat_ids(tok, STORY * 12 + "What did the keeper write down?")
    long_b = chat_ids(tok, STORY * 7 + "Name one thing in the log.", system=None)
    assert len(long_a) > 400 and len(long_b) > 200
    short = [chat_ids(tok, q) for q in QUESTIONS]
    arrivals = [(0, GenerationRequest(f"s{i}", p, params)) for i, p in enumerate(short[:3])]
    arrivals += [
        (2, GenerationRequest("long_a", long_a, params)),  # while s0..s2 decode
        (3, GenerationRequest("s3", short[3], params)),
        (5, GenerationRequest("long_b", long_b, params)),
    ]
    e = make_engine(default_model, max_batch_size=8, max_prefill_tokens=160)
    mixed = run_staggered(e, arrivals)
    assert e.runner.stats.mixed_steps >= 3  # the long prompts were chunked beside running decodes
    simple = make_engine(default_model, simple=True)
    for _, r in arrivals:
        (alone,) = simple.generate([r])
        assert mixed[r.request_id] == alone.token_ids, r.request_id
        assert (
            mixed[r.request_id]
            == mlx_lm_greedy(default_model, r.prompt_tokens, N)[: len(alone.token_ids)]
        ), r.request_id
