"""The batch prefill bound of an engine that serves online requests, on the real paged engine
(tiny random llama): every step feeds at most `batch_prefill_beside_online` batch prompt
tokens before any online request has come (one arriving mid-step waits for that step), an
online prompt arriving then gets its whole prompt in the next step, and no token changes
against whole-budget steps (issue 49)."""

from __future__ import annotations

import numpy as np

from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.priority import engine_priority
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.core.scheduler import SchedulerStep
from batchmlx.engine.core import EngineCore
from batchmlx.engine.runners.paged import paged_engine
from tests.engine.test_engine_tiny import model  # noqa: F401  (the module's fixture)

CAP = 8  # batch prompt tokens a step may feed
ONLINE_AT = 2  # the online request comes after this many steps


def _engine(model, serves_online: bool) -> EngineCore:  # noqa: F811
    cfg = EngineSettings(block_size=4, cache_memory_mb=64, max_prefill_tokens=64,
                         max_batch_size=8, adaptive_width=False,
                         batch_prefill_beside_online=CAP, serves_online=serves_online)  # fmt: skip
    return paged_engine(model, None, context_length=256, config=cfg, seed=0)


def _requests() -> tuple[list[GenerationRequest], GenerationRequest]:
    rng = np.random.default_rng(11)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    batch = [
        GenerationRequest(
            f"b{i}", rng.integers(1, 97, size=30 + i).tolist(), params, priority=engine_priority(0)
        )
        for i in range(3)
    ]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    online = GenerationRequest("o0", rng.integers(1, 97, size=20).tolist(), greedy, priority=0)
    return batch, online


def _run(e: EngineCore) -> tuple[dict[str, list[int]], list[SchedulerStep]]:
    """Tokens by request, and each step the scheduler gave."""
    sched = e.runner.scheduler
    steps: list[SchedulerStep] = []
    schedule = sched.schedule

    def recorded() -> SchedulerStep | None:
        step = schedule()
        if step is not None:
            steps.append(step)
        return step

    sched.schedule = recorded  # type: ignore[method-assign]
    batch, online = _requests()
    for r in batch:
        e.add(r)
    outs: dict[str, list[int]] = {}
    n = 0
    while e.has_unfinished() or n <= ONLINE_AT:
        if n == ONLINE_AT:
            e.add(online)
        for o in e.step():
            outs[o.request_id] = o.token_ids
        n += 1
    return outs, steps


def _prompt_tokens(step: SchedulerStep, online: bool) -> int:
    return sum(s.num_new_tokens for s in step.seqs
               if not s.decode and (s.seq.request.priority == 0) == online)  # fmt: skip


def test_an_engine_serving_online_bounds_every_steps_batch_prefill(model):  # noqa: F811
    whole, whole_steps = _run(_engine(model, serves_online=False))
    assert _prompt_tokens(whole_steps[0], online=False) == 64  # a batch-only engine: whole steps
    outs, steps = _run(_engine(model, serves_online=True))
    assert [_prompt_tokens(s, online=False) for s in steps[:ONLINE_AT]] == [CAP] * ONLINE_AT
    assert max(_prompt_tokens(s, online=False) for s in steps) == CAP
    assert _prompt_tokens(steps[ONLINE_AT], online=True) == 20  # its whole prompt at once
    assert outs == whole  # same greedy tokens, every request once
