"""The decodes' dense KV (engine/kv/decode.py): kept across steps, refilled, rebuilt, bounded,
and never changing a token. Tiny random llama; the reference is mlx-lm's contiguous cache."""

from __future__ import annotations

import numpy as np
import pytest

from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.engine.kv.decode import MAX_SLOTS, DecodeKV
from batchmlx.engine.kv.paged import PagedKVStorage
from tests.engine.test_engine_tiny import (
    GREEDY,
    engine,
    model,  # noqa: F401  (the module's fixture)
    prompts,
    reference_greedy,
    reqs,
    staggered,
)


def churn() -> list[tuple[int, GenerationRequest]]:
    """Requests of different lengths arriving while others decode: sequences finish (free
    slots), new ones join into them, and the keys outgrow the copy's room."""
    rng = np.random.default_rng(3)
    out = []
    for i in range(24):
        prompt = rng.integers(1, 97, size=int(rng.integers(2, 12))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(3, 40)), temperature=0.0)
        out.append((i // 2, GenerationRequest(f"c{i}", prompt, params)))
    return out


def test_decodes_over_the_dense_copy_match_mlx_lm_and_the_gathered_keys(model):  # noqa: F811
    work = churn()
    dense = engine(model, max_batch_size=8, max_prefill_tokens=24, block_size=8)
    outs = staggered(dense, work)
    kv = dense.runner.decode_kv
    assert kv is not None
    # every way of keeping the copy was taken: rebuilds, joins into free slots
    assert kv.rebuilds >= 2 and kv.joins >= 2
    assert dense.runner.stats.peak_decode_kv_bytes > 0
    gathered = engine(
        model, max_batch_size=8, max_prefill_tokens=24, block_size=8, dense_decode=False
    )
    assert gathered.runner.decode_kv is None
    old = staggered(gathered, work)
    for _, r in work:
        ref = reference_greedy(model, r.prompt_tokens, r.params.max_tokens)
        assert outs[r.request_id].token_ids == ref, r.request_id
        assert old[r.request_id].token_ids == ref, r.request_id


def test_preempted_sequences_come_back_into_the_copy_with_their_tokens(model):  # noqa: F811
    ps = prompts()
    simple = engine(model, simple=True).generate(reqs(ps))
    # ~14 usable blocks of 4 tokens cannot hold 6 sequences of up to 32 tokens at once
    e = engine(model, memory_aware=False, cache_max_blocks=14, max_batch_size=6)
    e.runner.decode_kv.budget_bytes = 1 << 30  # (half so small a pool holds no copy)
    outs = e.generate(reqs(ps))
    assert e.runner.scheduler.stats.preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in simple]
    assert e.runner.decode_kv.rebuilds > 0


def test_a_copy_past_its_budget_is_not_made_and_steps_gather(model):  # noqa: F811
    ps = prompts()
    e = engine(model, max_batch_size=6)
    e.runner.decode_kv.budget_bytes = 1  # nothing fits
    outs = e.generate(reqs(ps))
    assert e.runner.stats.peak_decode_kv_bytes == 0 and e.runner.decode_kv.rebuilds == 0
    simple = engine(model, simple=True).generate(reqs(ps))
    assert [o.token_ids for o in outs] == [o.token_ids for o in simple]


@pytest.fixture
def kv() -> DecodeKV:
    import mlx.core as mx

    storage = PagedKVStorage(num_layers=1, n_kv_heads=2, head_dim=4, block_size=4,
                             dtype=mx.float32, max_blocks=64)  # fmt: skip
    return DecodeKV(storage, budget_bytes=1 << 20)


def test_the_plan_keeps_slots_fills_free_ones_and_rebuilds_when_it_must(kv):
    tables = {s: list(range(1 + 8 * i, 9 + 8 * i)) for i, s in enumerate("abcdef")}
    p = kv.plan(["a", "b", "c", "d"], [5, 6, 7, 8], [tables[s] for s in "abcd"])
    assert p.rebuild_runs is not None and kv.capacity == 16  # room in steps of 2 blocks
    assert p.slot_rows is None and p.row_slots is None  # slot i is row i
    assert kv.held == [6, 7, 8, 9]

    p = kv.plan(["a", "b", "c", "d"], [6, 7, 8, 9], [tables[s] for s in "abcd"])
    assert p.rebuild_runs is None and p.join_rows is None  # one new row each, in place
    assert p.write_rows.tolist()[:2] == [(0 * 2 + 0) * 16 + 6, (0 * 2 + 1) * 16 + 6]

    # b finished, e joins into its slot (with its 4 earlier keys per head from the pool)
    p = kv.plan(["a", "c", "d", "e"], [7, 9, 10, 4], [tables[s] for s in "acde"])
    assert p.rebuild_runs is None and kv.slots == ["a", "e", "c", "d"]
    assert p.row_slots.tolist() == [0, 2, 3, 1] and p.slot_rows.tolist() == [0, 3, 1, 2]
    assert len(p.join_rows.tolist()) == 2 * 4  # heads x keys before the new one
    mask = np.array(p.mask)[:, 0, 0, :]
    assert mask.sum(axis=1).tolist() == [8, 5, 10, 11]

    # c is left out of a step: its slot frees; back later, it is a new joiner again
    kv.plan(["a", "d", "e"], [8, 11, 5], [tables[s] for s in "ade"])
    assert kv.slots == ["a", "e", None, "d"]

    # more joiners than free slots: rebuilt in row order
    p = kv.plan(["a", "d", "e", "c", "f"], [9, 12, 6, 10, 2], [tables[s] for s in "adecf"])
    assert p.rebuild_runs is not None and kv.slots == ["a", "d", "e", "c", "f"]

    # keys past the room: rebuilt with more
    p = kv.plan(["a", "d", "e", "c", "f"], [10, 16, 7, 11, 3], [tables[s] for s in "adecf"])
    assert p.rebuild_runs is not None and kv.capacity == 24


def test_a_quarter_of_the_slots_free_compacts_the_copy(kv):
    tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(8)]
    ids = [f"s{i}" for i in range(8)]
    kv.plan(ids, [3] * 8, tables)
    p = kv.plan(ids[:6], [4] * 6, tables[:6])  # 2 of 8 free: kept
    assert p.rebuild_runs is None and len(kv.slots) == 8
    p = kv.plan(ids[:5], [5] * 5, tables[:5])  # 3 of 8 free: compacted
    assert p.rebuild_runs is not None and kv.slots == ids[:5]


def test_greedy_default_is_on_and_the_plan_is_for_decode_rows_only(model):  # noqa: F811
    e = engine(model, max_batch_size=4)
    assert e.runner.decode_kv is not None
    (out,) = e.generate([GenerationRequest("x", prompts()[0], GREEDY)])
    assert out.token_ids == reference_greedy(model, prompts()[0], GREEDY.max_tokens)


def test_a_sequence_that_missed_steps_refills_its_own_slot(kv):
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    kv.plan(["a", "b", "c"], [3, 3, 3], tables)
    p = kv.plan(["a", "b", "c"], [4, 7, 4], tables)  # b's copy holds 4 keys, not 7
    assert p.rebuild_runs is None and kv.refills == 1 and kv.slots == ["a", "b", "c"]
    assert len(p.join_rows.tolist()) == 2 * 7  # heads x b's keys before its new one
    assert kv.held == [5, 8, 5]


def test_decodes_behind_a_shared_prefix_keep_it_once_and_match_mlx_lm(model, monkeypatch):  # noqa: F811
    from batchmlx.engine.kv import paged as kv_cache

    monkeypatch.setattr(kv_cache, "MIN_CASCADE_BLOCKS", 2)  # a prefix of this test's size
    rng = np.random.default_rng(5)
    shared = rng.integers(1, 97, size=13).tolist()
    ps = [shared + rng.integers(1, 97, size=n).tolist() for n in (1, 3, 6, 2, 5)]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (20, 6, 14, 9, 17)]
    work = [GenerationRequest(f"p{i}", p, params[i]) for i, p in enumerate(ps)]
    e = engine(model, max_batch_size=8)
    outs = e.generate(work)
    kv = e.runner.decode_kv
    # gathered once per run of steps sharing it (the copy is rebuilt as sequences finish)
    assert 0 < kv.prefix_gathers < e.runner.stats.decode_steps + e.runner.stats.mixed_steps
    for r, o in zip(work, outs, strict=True):
        assert o.token_ids == reference_greedy(model, r.prompt_tokens, r.params.max_tokens)


def test_a_long_sequence_among_short_ones_gathers_and_the_copy_is_kept(kv):
    tables = {s: list(range(1 + 12 * i, 13 + 12 * i)) for i, s in enumerate("abcd")}
    kv.plan(["a", "b", "c"], [3, 3, 3], [tables[s] for s in "abc"])
    # d's 41 keys would make every slot 41 long for 12 + 41 held: this step gathers
    assert kv.plan(["a", "b", "c", "d"], [4, 4, 4, 40], [tables[s] for s in "abcd"]) is None
    assert kv.slots == ["a", "b", "c"] and kv.capacity == 8  # kept, not dropped
    # d gone: a, b and c missed that step in the copy, and refill their own slots
    p = kv.plan(["a", "b", "c"], [5, 5, 5], [tables[s] for s in "abc"])
    assert p.rebuild_runs is None and kv.refills == 3 and kv.held == [6, 6, 6]


def test_no_copy_wider_than_its_slot_bound_those_steps_gather(kv):
    n = MAX_SLOTS + 1
    ids = [f"s{i}" for i in range(n)]
    tables = [[1 + i] for i in range(n)]
    assert kv.plan(ids, [2] * n, tables) is None  # one decode too many: the step gathers
    assert kv.capacity == 0 and kv.rebuilds == 0
    p = kv.plan(ids[:MAX_SLOTS], [2] * MAX_SLOTS, tables[:MAX_SLOTS])
    assert p is not None and kv.rebuilds == 1 and len(kv.slots) == MAX_SLOTS
