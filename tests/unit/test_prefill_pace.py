"""Beside online work a step carries the batch prompt tokens that keep it within
online_step_ratio decode steps, by measured time (core/prefill_pace.py; issue 49, item 3). The
clock is injected and moved by a cost model of the step, so the figures are exact."""

from __future__ import annotations

import pytest

from batchmlx.core.prefill_pace import REFRESH, PrefillPace
from batchmlx.core.priority import engine_priority
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.core.scheduler import Scheduler, SchedulerConfig, SchedulerStep
from tests.unit.test_scheduler import alone, assert_all_free, drive, runner_for

BATCH = engine_priority(0)


def test_the_pace_fits_the_prompt_tokens_a_decode_step_leaves_room_for():
    pace = PrefillPace(ratio=2.0, ceiling=256)
    assert pace.tokens() == 0  # first a step without batch prompts: a decode step's time
    pace.observe(40, 0.5)  # an online prompt in it: not a decode step, nothing to subtract
    assert pace.tokens() == 0 and pace.token_s is None
    pace.observe(0, 0.1)
    assert pace.tokens() == 256  # then the token bound: what a prompt token adds
    pace.observe(100, 0.3)  # 100 tokens added 0.2 s
    assert pace.tokens() == 50  # (2 - 1) x 0.1 s / 2 ms
    pace.observe(0, 0.2)  # the load doubled the decode step: 0.1 + 0.2 x 0.1 = 0.12 s
    assert pace.decode_s == pytest.approx(0.12)
    assert pace.tokens() == 60
    for _ in range(REFRESH):  # steps with prompts only: a decode step is measured again
        assert pace.tokens() == 60
        pace.observe(60, 0.24)
    assert pace.tokens() == 0
    assert PrefillPace(2.0, 256, floor=16, decode_s=0.1, token_s=0.1).tokens() == 16
    assert PrefillPace(2.0, 8, decode_s=0.1, token_s=1e-6).tokens() == 8
    assert PrefillPace(0.0, 256).tokens() == 256  # off: the token bound alone


class CostClock:
    """A step takes 0.1 s + 2 ms a prompt token: the clock moves by it between schedule() and
    update()."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def run(self, step: SchedulerStep) -> float:
        took = 0.1 + 0.002 * sum(s.num_new_tokens for s in step.seqs if not s.decode)
        self.now += took
        return took


def test_beside_online_work_steps_stay_within_twice_a_decode_step():
    clock = CostClock()
    cfg = SchedulerConfig(max_batch_size=16, block_size=4, num_blocks=1024, max_prefill_tokens=512,
                          batch_prefill_beside_online=256, online_step_ratio=2.0,
                          online_linger_s=0.0)  # fmt: skip
    sched = Scheduler(cfg, clock=clock)
    runner = runner_for(sched)
    sched.add(GenerationRequest("o0", [9, 8, 7], SamplingParams(max_tokens=60, temperature=0.0),
                                priority=0))  # fmt: skip
    prompts = {f"b{i}": [(i + k) % 90 + 1 for k in range(200)] for i in range(6)}
    for rid, p in prompts.items():
        sched.add(GenerationRequest(rid, p, SamplingParams(max_tokens=4, temperature=0.0),
                                    priority=BATCH))  # fmt: skip
    times, batch_prompt = [], []
    while sched.get("o0") is not None:
        step = sched.schedule()
        batch_prompt.append(sum(s.num_new_tokens for s in step.seqs
                                if not s.decode and s.seq.request.priority))  # fmt: skip
        times.append(clock.run(step))
        sched.update(step, *runner.run(step))
    # o0's prompt, then its first decode with no batch prompt (a decode step measured), the
    # token bound once (a prompt token's cost measured), then 50 tokens a step: 0.2 s at most
    assert batch_prompt[:4] == [0, 0, 256, 50]
    assert max(times[3:]) <= 0.2 + 1e-9
    assert 50 in batch_prompt[4:] and max(batch_prompt[3:]) == 50
    clock_free = drive(sched)[0]  # online work done: whole steps again, same outputs
    assert all(clock_free[rid] == alone(p, 4) for rid, p in prompts.items() if rid in clock_free)
    assert_all_free(sched)
