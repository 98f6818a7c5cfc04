"""Preemption for online work and resume, on the real paged engine (tiny random llama): a batch
sequence that gives its slot to an online request comes back with the same greedy tokens, once;
the prefix cache keeps its blocks, so only its last, partial block is recomputed; and batch
decodes paused beside online work (core/decode_turns.py) change no token (issue 49)."""

from __future__ import annotations

import numpy as np
import pytest

from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.priority import engine_priority
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.core.sequence import Sequence
from batchmlx.engine.core import EngineCore
from batchmlx.engine.runners.paged import paged_engine
from tests.engine.test_engine_tiny import model  # noqa: F401  (the module's fixture)

BS = 4  # tokens per block
BATCH = engine_priority(0)
PARAMS = SamplingParams(max_tokens=24, temperature=0.0)


def _engine(model, **cfg) -> EngineCore:  # noqa: F811
    base = dict(block_size=BS, cache_memory_mb=64, max_prefill_tokens=64, max_batch_size=4,
                adaptive_width=False)  # fmt: skip
    base.update(cfg)
    return paged_engine(model, None, context_length=256, config=EngineSettings(**base), seed=0)


def _batch() -> list[GenerationRequest]:
    rng = np.random.default_rng(7)
    return [
        GenerationRequest(
            f"b{i}", rng.integers(1, 97, size=9 + 2 * i).tolist(), PARAMS, priority=BATCH
        )  # fmt: skip
        for i in range(4)
    ]


def _online() -> GenerationRequest:
    prompt = np.random.default_rng(8).integers(1, 97, size=6).tolist()
    return GenerationRequest("o0", prompt, SamplingParams(max_tokens=10, temperature=0.0),
                             priority=0)  # fmt: skip


def _run(e: EngineCore, online_after: int | None) -> tuple[dict[str, list[int]], list[str]]:
    """The batch, and the online request after `online_after` steps; the token ids of each
    request and the ids in the order they finished (each must finish once)."""
    for r in _batch():
        e.add(r)
    outs: dict[str, list[int]] = {}
    order: list[str] = []
    steps = 0
    while e.has_unfinished() or (online_after is not None and steps <= online_after):
        if steps == online_after:
            e.add(_online())
        for o in e.step():
            order.append(o.request_id)
            outs[o.request_id] = o.token_ids
        steps += 1
    return outs, order


def _victim(e: EngineCore) -> Sequence:
    (seq,) = [s for s in e.runner.scheduler.waiting if s.num_preemptions]
    return seq


def test_a_batch_sequence_preempted_for_online_work_resumes_with_the_same_greedy_tokens(
    model,  # noqa: F811
):
    alone, _ = _run(_engine(model), None)
    e = _engine(model)
    outs, order = _run(e, online_after=6)
    stats = e.runner.scheduler.stats
    assert stats.urgent_preemptions == 1
    assert sorted(order) == ["b0", "b1", "b2", "b3", "o0"]  # every request once, none lost
    for rid, tokens in alone.items():
        assert outs[rid] == tokens, rid
        assert len(tokens) == PARAMS.max_tokens
    assert len(outs["o0"]) == 10


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_resuming_recomputes_only_the_tokens_the_prefix_cache_lost(model, prefix_cache):  # noqa: F811
    e = _engine(model, use_paged_cache=prefix_cache)
    for r in _batch():
        e.add(r)
    for _ in range(6):  # every batch prompt computed; the four decode
        e.step()
    sched = e.runner.scheduler
    computed = sched.stats.prefill_tokens_computed
    e.add(_online())
    e.step()  # b3, the latest admitted, gives its slot to o0
    victim = _victim(e)
    assert victim.seq_id == "b3"
    tokens = victim.num_tokens  # its prompt and what it generated, the last one not yet fed
    while e.has_unfinished():
        e.step()
    recomputed = sched.stats.prefill_tokens_computed - computed - len(_online().prompt_tokens)
    if prefix_cache:  # its full blocks came back from the cache: only the partial one is fed
        assert recomputed == tokens - (tokens - 1) // BS * BS
        assert recomputed <= BS
    else:
        assert recomputed == tokens
    assert victim.num_preemptions == 1


def test_batch_decodes_paused_beside_online_work_change_no_token(model):  # noqa: F811
    alone, _ = _run(_engine(model), None)
    e = _engine(model, batch_decodes_beside_online=1)
    outs, order = _run(e, online_after=6)
    stats = e.runner.scheduler.stats
    assert stats.paused_decodes > 0 and stats.urgent_preemptions == 1
    assert sorted(order) == ["b0", "b1", "b2", "b3", "o0"]
    for rid, tokens in alone.items():
        assert outs[rid] == tokens, rid
