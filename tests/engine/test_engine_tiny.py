"""The paged continuous-batching engine on a tiny random-weight llama: exact parity checks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.request import CacheOutcome, FinishReason, GenerationRequest, SamplingParams
from batchmlx.engine.core import EngineCore
from batchmlx.engine.runners.paged import FORECAST_TOKENS, paged_engine
from tests.engine.helpers import random_llama

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return random_llama()


def engine(model, **cfg) -> EngineCore:
    base = dict(block_size=4, cache_memory_mb=64, max_prefill_tokens=64)
    base.update(cfg)
    return paged_engine(model, None, context_length=256, config=EngineSettings(**base), seed=0)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    shared = rng.integers(1, 97, size=11).tolist()
    return [
        shared + rng.integers(1, 97, size=5).tolist(),
        shared + rng.integers(1, 97, size=2).tolist(),
        rng.integers(1, 97, size=7).tolist(),
        shared[:6],
        shared + rng.integers(1, 97, size=9).tolist(),
        rng.integers(1, 97, size=3).tolist(),
    ]


def reqs(ps, params=GREEDY, prefix="r"):
    return [GenerationRequest(f"{prefix}{i}", p, params) for i, p in enumerate(ps)]


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own contiguous KV cache, one sequence: the ground truth for paged attention."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


def test_paged_single_matches_mlx_lm_contiguous_cache(model):
    for p in prompts():
        (out,) = engine(model, simple=True).generate(reqs([p]))
        assert out.token_ids == reference_greedy(model, p, 12)
        assert out.finish_reason is FinishReason.LENGTH


def test_batched_tokens_equal_simple_mode(model):
    ps = prompts()
    simple = engine(model, simple=True).generate(reqs(ps))
    batched = engine(model, max_batch_size=4).generate(reqs(ps))
    assert [o.token_ids for o in batched] == [o.token_ids for o in simple]


def test_logprobs_batched_equal_single_within_tolerance(model):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)
    ps = prompts()
    single = [engine(model).generate(reqs([p], params))[0] for p in ps]
    batched = engine(model).generate(reqs(ps, params))
    for s, b in zip(single, batched, strict=True):
        assert [t.token_id for t in s.logprobs] == [t.token_id for t in b.logprobs]
        np.testing.assert_allclose(
            [t.logprob for t in s.logprobs], [t.logprob for t in b.logprobs], atol=1e-4
        )
        assert len(b.logprobs[0].top) == 3


def test_seeded_sampling_same_alone_or_in_batch(model):
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    p = prompts()[0]
    (alone,) = engine(model).generate([GenerationRequest("x", p, seeded)])
    mixed = [GenerationRequest("x", p, seeded)] + reqs(prompts()[1:], GREEDY)
    in_batch = engine(model).generate(mixed)[0]
    assert alone.token_ids == in_batch.token_ids
    assert len(alone.token_ids) == 10


def test_per_request_parameters_inside_one_batch(model):
    p = prompts()[0]
    batch = [
        GenerationRequest("a", p, SamplingParams(max_tokens=3, temperature=0.0)),
        GenerationRequest("b", p, SamplingParams(max_tokens=9, temperature=0.0)),
        GenerationRequest("c", p, SamplingParams(max_tokens=5, temperature=1.0, seed=7)),
    ]
    a, b, c = engine(model).generate(batch)
    assert len(a.token_ids) == 3 and len(b.token_ids) == 9 and len(c.token_ids) == 5
    assert a.token_ids == b.token_ids[:3]


def test_stop_token_ends_a_sequence(model):
    p = prompts()[2]
    ref = reference_greedy(model, p, 12)
    stop = ref[4]
    first = ref.index(stop)
    r = GenerationRequest("s", p, SamplingParams(max_tokens=12, temperature=0.0), frozenset({stop}))
    (out,) = engine(model).generate([r])
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == ref[:first]


def test_prefix_cache_outcomes_and_reuse(model):
    e = engine(model)
    ps = prompts()
    (first,) = e.generate(reqs([ps[0]], prefix="a"))
    (again,) = e.generate(reqs([ps[0]], prefix="b"))
    (other,) = e.generate(reqs([ps[2]], prefix="c"))
    (sibling,) = e.generate(reqs([ps[4]], prefix="d"))
    (back,) = e.generate(reqs([ps[0]], prefix="e"))
    assert first.cache_outcome is CacheOutcome.MISS and first.cached_tokens == 0
    assert again.cache_outcome is CacheOutcome.HIT
    assert again.cached_tokens == (len(ps[0]) - 1) // 4 * 4
    assert other.cache_outcome is CacheOutcome.MISS
    assert sibling.cache_outcome is CacheOutcome.PREFIX_HIT and sibling.cached_tokens == 8
    assert back.cache_outcome is CacheOutcome.HIT
    # reuse changes nothing in the tokens
    assert again.token_ids == first.token_ids == back.token_ids


def test_preemption_under_a_tiny_cache_keeps_outputs(model):
    ps = prompts()
    simple = engine(model, simple=True).generate(reqs(ps))
    # 4 tokens a block; ~14 usable blocks cannot hold 6 sequences of up to 32 tokens at once
    e = engine(model, memory_aware=False, cache_max_blocks=14, max_batch_size=6)
    outs = e.generate(reqs(ps))
    assert [o.token_ids for o in outs] == [o.token_ids for o in simple]
    assert e.runner.scheduler.stats.preemptions > 0
    assert e.runner.stats.bound_violations == 0
    assert e.runner.storage.peak_nbytes <= e.runner.stats.kv_bound_bytes


def test_sharing_lowers_allocated_kv_memory(model):
    shared = list(range(1, 41))
    ps = [shared + [50 + i] for i in range(8)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    # fine-grained growth so the allocated arrays track the blocks in use
    on = engine(model, use_paged_cache=True, max_batch_size=8, kv_grow_blocks=4)
    off = engine(model, use_paged_cache=False, max_batch_size=8, kv_grow_blocks=4)
    a = on.generate(reqs(ps, params))
    b = off.generate(reqs(ps, params))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert on.runner.stats.peak_kv_bytes < off.runner.stats.peak_kv_bytes / 2


def test_the_kv_pool_grows_at_once_to_what_the_running_requests_may_need(model):
    """A growth goes to the forecast (the blocks handed out, plus each running request's
    blocks still to come at its max_tokens, or in its next FORECAST_TOKENS): six unrelated
    prompts decoding 20 tokens each from a one-block pool grow it once, in the first step, to
    room for all of it and no more (grown by half at a time: three growths). One request that
    may run long grows it to its next FORECAST_TOKENS tokens. (A request admitted later, or
    one waiting for a shared prefix to be computed, may grow it again.)"""
    params = SamplingParams(max_tokens=20, temperature=0.0)
    rng = np.random.default_rng(4)
    ps = [rng.integers(1, 97, size=n).tolist() for n in (13, 17, 22, 15, 19, 26)]
    e = engine(model, max_batch_size=8, kv_grow_blocks=1, max_prefill_tokens=256)  # all at once
    assert e.runner.storage.growths == 1 and e.runner.storage.capacity_blocks == 1
    out = e.generate(reqs(ps, params))
    assert [len(o.token_ids) for o in out] == [20] * len(ps)
    assert e.runner.storage.growths == 2
    assert e.runner.storage.capacity_blocks == 1 + sum(-(-(len(p) + 20) // 4) for p in ps)  # + null

    long = engine(model, kv_grow_blocks=1)
    long.add(GenerationRequest("long", ps[0], SamplingParams(max_tokens=200, temperature=0.0)))
    long.step()
    assert long.runner.storage.capacity_blocks == 1 + -(-(len(ps[0]) + FORECAST_TOKENS) // 4)


def test_the_context_is_the_smaller_of_the_model_and_the_kv_pool(model):
    small = engine(model, memory_aware=False, cache_max_blocks=8)  # 8 usable blocks of 4
    assert small.max_context_tokens == 32
    assert engine(model).max_context_tokens == 256
    with pytest.raises(ValueError, match="no room"):  # the worker checks first: a 400
        small.add(GenerationRequest("r", list(range(1, 33)), GREEDY))
    out = small.generate([GenerationRequest("s", list(range(1, 30)), GREEDY)])[0]
    assert len(out.token_ids) == 3  # max_tokens bounded by the room left
    assert out.finish_reason is FinishReason.LENGTH


def test_a_stop_string_ends_generation_on_the_decoded_text(model):
    class Digits:  # token i decodes to "<i>"
        def decode(self, ids: list[int]) -> str:
            return "".join(f"<{i}>" for i in ids)

    free = engine(model).generate(reqs([prompts()[0]]))[0].token_ids
    stop = f"<{free[2]}>"
    eng = engine(model)
    eng.tokenizer = Digits()
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,))
    out = eng.generate(reqs([prompts()[0]], params))[0]
    first = next(i for i, t in enumerate(free) if f"<{t}>" == stop)
    assert out.token_ids == free[: first + 1]  # stops on the token completing the string
    assert out.finish_reason is FinishReason.STOP


class StepClock:
    """Every reading is one second later: a step's seconds are a constant number of readings,
    so throughput grows with the width and the width controller decides deterministically."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def many_prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, 97, size=int(rng.integers(2, 12))).tolist() for _ in range(n)]


def test_the_adaptive_width_grows_and_keeps_greedy_tokens(model):
    from batchmlx.core.width import WidthController, WidthPolicy

    ps = many_prompts(48)
    simple = engine(model, simple=True).generate(reqs(ps))
    cfg = EngineSettings(block_size=4, cache_memory_mb=64, max_batch_size=32)
    e = paged_engine(model, None, context_length=256, seed=0, clock=StepClock(), config=cfg)
    e.runner.width = WidthController(WidthPolicy(cap=32, initial=2, window_steps=2))
    e.runner.scheduler.running_limit = 2
    outs = e.generate(reqs(ps))
    assert [o.token_ids for o in outs] == [o.token_ids for o in simple]
    grown = [c.new for c in e.runner.width.changes if c.reason == "faster"]
    assert grown[:2] == [4, 8]
    assert e.runner.scheduler.stats.peak_running > 2
    assert e.runner.scheduler.stats.preemptions == 0


def test_queued_work_that_fits_is_admitted_at_once_and_keeps_greedy_tokens(model):
    from batchmlx.core.width import WidthController, WidthPolicy

    ps = many_prompts(24)
    simple = engine(model, simple=True).generate(reqs(ps))

    def run(blocks: int) -> EngineCore:
        cfg = EngineSettings(block_size=4, memory_aware=False, cache_max_blocks=blocks,
                             max_batch_size=32)  # fmt: skip
        e = paged_engine(model, None, context_length=256, seed=0, clock=StepClock(), config=cfg)
        e.runner.width = WidthController(WidthPolicy(cap=32, initial=4, window_steps=2))
        e.runner.scheduler.running_limit = 4
        outs = e.generate(reqs(ps))
        assert [o.token_ids for o in outs] == [o.token_ids for o in simple]
        return e

    e = run(blocks=1000)
    first = e.runner.width.changes[0]
    assert (first.step, first.old, first.new, first.reason) == (1, 4, 24, "fits")
    assert e.runner.scheduler.stats.peak_running == 24
    # a pool that cannot hold all 24 at their longest (3+ blocks each): measured, as before
    small = run(blocks=60)
    assert "fits" not in {c.reason for c in small.runner.width.changes}


def test_the_adaptive_width_shrinks_under_memory_pressure(model):
    ps = many_prompts(24)
    simple = engine(model, simple=True).generate(reqs(ps))
    # 14 usable blocks of 4 tokens: 12 sequences of up to 23 tokens cannot all stay
    e = paged_engine(model, None, context_length=256, seed=0, clock=StepClock(),
               config=EngineSettings(block_size=4, memory_aware=False, cache_max_blocks=14,
                                     max_batch_size=12))  # fmt: skip
    fixed = paged_engine(model, None, context_length=256, seed=0,
                   config=EngineSettings(block_size=4, memory_aware=False, cache_max_blocks=14,
                                         max_batch_size=12, adaptive_width=False))  # fmt: skip
    outs = e.generate(reqs(ps))
    assert [o.token_ids for o in outs] == [o.token_ids for o in simple]
    assert [o.token_ids for o in fixed.generate(reqs(ps))] == [o.token_ids for o in simple]
    shrinks = [c for c in e.runner.width.changes if c.reason == "memory"]
    assert shrinks and all(c.new < c.old for c in shrinks)
    # narrowing after the first preemptions spares the pool most of the fixed width's
    assert 0 < e.runner.scheduler.stats.preemptions < fixed.runner.scheduler.stats.preemptions


# -- mixed steps, packed: decodes never wait for a prefill ----------------------------------


def staggered(e: EngineCore, arrivals: list[tuple[int, GenerationRequest]]) -> dict[str, object]:
    """Add each request at its step number, run to the end; outputs by id. Records every
    streamed token through on_token."""
    streamed: dict[str, list[int]] = {}
    e.on_token = lambda rid, tok: streamed.setdefault(rid, []).append(tok)
    outs: dict[str, object] = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    n = 0
    while pending or e.has_unfinished():
        while pending and pending[0][0] <= n:
            e.add(pending.pop(0)[1])
        for o in e.step():
            outs[o.request_id] = o
        n += 1
    for rid, o in outs.items():
        assert streamed.get(rid, []) == o.token_ids  # streaming unchanged
    return outs


def mixed_workload(params=GREEDY) -> list[tuple[int, GenerationRequest]]:
    rng = np.random.default_rng(7)
    ps = prompts()
    long = [rng.integers(1, 97, size=n).tolist() for n in (70, 45)]
    return [
        (0, GenerationRequest("s0", ps[0], params)),
        (0, GenerationRequest("s1", ps[2], params)),
        (1, GenerationRequest("s2", ps[1], params)),
        (3, GenerationRequest("long0", long[0], params)),  # arrives while s0..s2 decode
        (4, GenerationRequest("s3", ps[4], params)),
        (6, GenerationRequest("long1", ps[0] + long[1], params)),  # a prefix hit, then chunks
        (8, GenerationRequest("s4", ps[5], params)),
    ]


def test_mixed_packed_steps_match_mlx_lm_and_unmixed_steps(model):
    work = mixed_workload()
    mixed = engine(model, max_batch_size=8, max_prefill_tokens=24)
    assert mixed.runner.forward_pass.packs  # llama has the attention seam: steps run packed
    outs = staggered(mixed, work)
    # the long prompts were chunked in steps that also decoded the running sequences
    assert mixed.runner.stats.mixed_steps >= 4
    assert mixed.runner.scheduler.stats.mixed_steps == mixed.runner.stats.mixed_steps
    unmixed = engine(model, max_batch_size=8, max_prefill_tokens=24, mixed_steps=False)
    old = staggered(unmixed, work)
    assert unmixed.runner.stats.mixed_steps == 0
    for _, r in work:
        ref = reference_greedy(model, r.prompt_tokens, 12)
        assert outs[r.request_id].token_ids == ref, r.request_id
        assert old[r.request_id].token_ids == ref, r.request_id


def test_mixed_steps_keep_logprobs_and_seeded_sampling(model):
    lp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    work = mixed_workload(lp)
    work[3] = (3, GenerationRequest("long0", work[3][1].prompt_tokens, seeded))
    outs = staggered(engine(model, max_batch_size=8, max_prefill_tokens=24), work)
    for _, r in work:
        (single,) = engine(model, simple=True).generate([r])
        got = outs[r.request_id]
        assert got.token_ids == single.token_ids, r.request_id
        if r.params.logprobs:
            assert [t.token_id for t in got.logprobs] == [t.token_id for t in single.logprobs]
            np.testing.assert_allclose(
                [t.logprob for t in got.logprobs], [t.logprob for t in single.logprobs],
                atol=1e-4,
            )  # fmt: skip


def test_packed_layout_feeds_each_token_once_at_its_position():
    from batchmlx.engine.kv.paged import (
        BatchLayout,
        PackedLayout,
        SegmentKind,
    )

    kw = dict(
        block_size=4, n_kv_heads=2, token_chunks=[[5, 6, 7, 8, 9], [3], [4, 2], [1]],
        starts=[2, 9, 0, 4], block_tables=[[1, 2], [3, 4, 5], [6], [1, 7]],
    )  # fmt: skip
    packed, padded = PackedLayout.build(**kw), BatchLayout.build(**kw)
    # one-token rows first, then each chunk; no padding anywhere
    assert packed.tokens[:, 0].tolist() == [3, 1, 5, 6, 7, 8, 9, 4, 2]
    assert packed.offsets.tolist() == [9, 4, 2, 3, 4, 5, 6, 0, 1]
    assert packed.last_index.tolist() == [6, 0, 8, 1]
    # the two chunks (5 and 2 tokens) pad to 10 queries for 7 real ones: one segment
    assert [(s.first, s.length, s.kind, s.batch, s.queries) for s in packed.segments] == [
        (0, 2, SegmentKind.ROWS, 2, 1), (2, 7, SegmentKind.CHUNKS, 2, 5)
    ]  # fmt: skip
    assert packed.segments[1].pad_rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 0, 0]
    assert packed.segments[1].real_rows.tolist() == [0, 1, 2, 3, 4, 5, 6]
    # the same KV rows as the padded layout writes, token for token
    pad = np.array(padded.write_rows.tolist()).reshape(4, 2, 2 + 3)  # [B, H, Q]
    rows = np.array(packed.write_rows.tolist()).reshape(9, 2)  # [T, H]
    order = [(1, 0), (3, 0)] + [(0, q) for q in range(5)] + [(2, 0), (2, 1)]
    for t, (b, q) in enumerate(order):
        assert rows[t].tolist() == pad[b, :, q].tolist()


def test_packed_decodes_sharing_a_prefix_keep_the_cascade(monkeypatch):
    from batchmlx.engine.kv import paged as kv_cache
    from batchmlx.engine.kv.paged import PackedLayout, SegmentKind

    monkeypatch.setattr(kv_cache, "MIN_CASCADE_BLOCKS", 1)  # a prefix of this test's size

    layout = PackedLayout.build(
        block_size=4, n_kv_heads=2, token_chunks=[[1], [2], [3, 4, 5]], starts=[9, 10, 0],
        block_tables=[[1, 2, 3], [1, 2, 4], [5]],
    )  # fmt: skip
    rows, chunk = layout.segments
    assert chunk.kind is SegmentKind.CHUNK
    assert rows.prefix_runs is not None and rows.prefix_runs.shape == (2, 2)  # blocks 1, 2
    assert chunk.prefix_runs is None  # one sequence: nothing to share


def test_a_mixed_step_attends_by_segment(model):
    from batchmlx.engine.kernels.attention import AttentionRoute, segment_attention

    shapes: list[tuple[int, int, int]] = []  # (batch, queries, keys) of each segment call

    def attend(queries, keys, values, scale, mask, *, causal_offset=None):
        shapes.append((queries.shape[0], queries.shape[2], keys.shape[2]))
        return segment_attention(queries, keys, values, scale, mask, causal_offset=causal_offset)

    e = engine(model, max_batch_size=8, max_prefill_tokens=24, use_paged_cache=False)
    e.runner.forward_pass.attention = AttentionRoute(model, attend=attend)
    e.add(GenerationRequest("a", prompts()[2], GREEDY))  # 7 tokens
    e.add(GenerationRequest("b", prompts()[5], GREEDY))  # 3 tokens
    e.step()  # both prompts: chunks of 7 and 3 tokens, close enough to share one segment
    assert shapes == [(2, 7, 8), (2, 7, 8)]  # one call per layer (2 layers)
    shapes.clear()
    e.add(GenerationRequest("long", list(range(1, 41)), GREEDY))
    e.step()  # a mixed step: a and b decode beside the first 22 tokens of the long prompt
    assert e.runner.stats.mixed_steps == 1
    assert sorted(shapes) == [(1, 22, 24), (1, 22, 24), (2, 1, 8), (2, 1, 8)]


def test_a_model_without_the_attention_seam_keeps_unmixed_padded_steps(model, monkeypatch):
    from batchmlx.engine.runners.paged_forward import PagedForward

    monkeypatch.setattr(PagedForward, "packs", property(lambda self: False))
    e = engine(model, max_batch_size=8, max_prefill_tokens=24)
    assert not e.runner.mixed_steps and not e.runner.scheduler.config.mixed_steps
    outs = staggered(e, mixed_workload())
    assert e.runner.stats.mixed_steps == 0
    for _, r in mixed_workload():
        assert outs[r.request_id].token_ids == reference_greedy(model, r.prompt_tokens, 12)


def test_chunks_of_similar_length_share_a_segment_and_a_long_one_stays_alone():
    from batchmlx.engine.kv.paged import _chunk_groups

    assert _chunk_groups([20, 480, 18, 22, 15]) == [[1], [3, 0, 2, 4]]  # 4*22 <= 1.5*75
    assert _chunk_groups([30, 9]) == [[0], [1]]  # 2*30 > 1.5*39


def test_prompt_chunks_behind_a_cached_prefix_run_as_one_cascade_segment(model, monkeypatch):
    from batchmlx.engine.kernels.attention import AttentionRoute, cascade_attention
    from batchmlx.engine.kv import paged as kv_cache

    monkeypatch.setattr(kv_cache, "MIN_CASCADE_BLOCKS", 1)  # a prefix of this test's size

    calls: list[tuple[int, int]] = []  # (batch, queries) of each cascade call

    def counting(queries, keys, values, prefix, scale, mask, *, causal_offset=None,
                 real_rows=None):  # fmt: skip
        calls.append((queries.shape[0], queries.shape[2]))
        return cascade_attention(queries, keys, values, prefix, scale, mask,
                                 causal_offset=causal_offset)  # fmt: skip

    rng = np.random.default_rng(3)
    system = rng.integers(1, 97, size=16).tolist()  # 4 full blocks
    tails = [rng.integers(1, 97, size=n).tolist() for n in (6, 5, 7)]
    e = engine(model, max_batch_size=8)
    e.runner.forward_pass.attention = AttentionRoute(model, prefix_attention=counting)
    e.generate([GenerationRequest("warm", system + [5], GREEDY)])  # caches the 4 blocks
    calls.clear()
    outs = e.generate(reqs([system + t for t in tails]))
    assert calls[:2] == [(3, 7), (3, 7)]  # the three chunks, padded to 7 queries, per layer
    for o, t in zip(outs, tails, strict=True):
        assert o.cached_tokens == 16
        assert o.token_ids == reference_greedy(model, system + t, 12)


def test_a_step_holds_no_layer_keys_past_the_layers_attention(model, monkeypatch):
    """Each layer's gathered keys and values are dropped once its attention has read them, so
    an evaluation barrier mid-step (host kernels) frees them instead of holding every layer's
    until the step ends (they came fresh from the OS at every barrier: page faults)."""
    from batchmlx.engine.kv import paged as kv_cache

    made = []
    init = kv_cache.PagedLayerCache.__init__

    def record(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(kv_cache.PagedLayerCache, "__init__", record)
    eng = engine(model, max_batch_size=4)
    eng.generate(reqs(prompts()[:3], SamplingParams(max_tokens=3, temperature=0.0)))
    assert made and all(c.segment_kv == [] and c.prefix is None for c in made)


def test_the_engine_raises_mlx_buffer_cache_on_the_cpu_only():
    from batchmlx.engine.kv import budget as llm_engine

    before = mx.set_cache_limit(32 << 20)
    try:
        assert llm_engine.size_buffer_cache(on_cpu=False) == 32 << 20  # a GPU keeps its own
        want = min(llm_engine.CPU_BUFFER_CACHE, llm_engine.available_memory_bytes(False) // 16)
        assert llm_engine.size_buffer_cache(on_cpu=True) == want
        mx.set_cache_limit(8 << 30)  # a limit set higher (by the user) is kept
        assert llm_engine.size_buffer_cache(on_cpu=True) == 8 << 30
        assert mx.set_cache_limit(0) == 8 << 30
    finally:
        mx.set_cache_limit(before)


def test_available_memory_counts_the_page_cache_the_kernel_can_drop(tmp_path):
    from batchmlx.engine.kv import budget as llm_engine

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 24000000 kB\nMemFree: 231000 kB\nMemAvailable: 23000000 kB\n")
    assert llm_engine._mem_available(str(meminfo)) == 23000000 * 1024  # not MemFree
    assert llm_engine._mem_available(str(tmp_path / "none")) is None
