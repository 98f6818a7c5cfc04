"""While online work runs, a step carries at most batch_decodes_beside_online batch decodes
(core/decode_turns.py): the inter-token tail of online streams under a batch (issue 49)."""

from __future__ import annotations

import pytest

from batchmlx.core.priority import engine_priority
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.core.scheduler import Scheduler, SchedulerConfig
from tests.unit.test_scheduler import alone, assert_all_free, drive, runner_for

BATCH = engine_priority(0)


def req(rid: str, prompt: list[int], max_tokens: int, priority: int) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return GenerationRequest(rid, prompt, params, priority=priority)


def _batch_running(mixed: bool) -> Scheduler:
    # no linger: the bounds lift with the online work's end (its own test: test_online_window)
    cfg = SchedulerConfig(max_batch_size=16, block_size=4, num_blocks=256,
                          batch_decodes_beside_online=3, mixed_steps=mixed,
                          online_linger_s=0.0)  # fmt: skip
    sched = Scheduler(cfg)
    for i in range(8):
        sched.add(req(f"b{i}", [i + 1, 2, 3], 20, priority=BATCH))
    runner = runner_for(sched)
    for _ in range(2):  # all eight admitted and decoding
        step = sched.schedule()
        sched.update(step, *runner.run(step))
    assert len(sched.running) == 8
    return sched


@pytest.mark.parametrize("mixed", [True, False])
def test_online_work_caps_the_batch_decodes_of_a_step_and_outputs_are_unchanged(mixed):
    sched = _batch_running(mixed)
    runner = runner_for(sched)
    sched.add(req("o0", [9, 9, 9, 9, 9], 6, priority=0))
    widths = []
    while sched.get("o0") is not None:
        step = sched.schedule()
        batch = [s.seq.seq_id for s in step.seqs if s.decode and s.seq.request.priority == BATCH]
        sched.update(step, *runner.run(step))
        if not any(s.decode for s in step.seqs):
            assert step.paused == 0  # an unmixed prefill step: nobody decodes
            continue
        widths.append(len(batch))
        # the earliest admitted take the turns; nobody is preempted for them
        assert batch == [f"b{i}" for i in range(len(batch))]
        assert step.preempted == []
        assert step.paused == 8 - len(batch)
    assert max(widths) == 3 and min(widths) >= 1  # capped, never starved
    assert sched.stats.paused_decodes == sum(8 - w for w in widths)
    step = sched.schedule()  # online work is done: the whole batch decodes again
    assert len([s for s in step.seqs if s.decode]) == 8 and step.paused == 0
    sched.update(step, *runner.run(step))
    outputs, _ = drive(sched)
    for i in range(8):
        assert outputs[f"b{i}"] == alone([i + 1, 2, 3], 20)
    assert_all_free(sched)


def test_batch_admissions_beside_online_work_stop_at_the_decode_turns():
    # the token bound alone (no measured pace: its first step would admit no batch prompt)
    cfg = SchedulerConfig(max_batch_size=16, block_size=4, num_blocks=256,
                          batch_decodes_beside_online=2, online_step_ratio=0.0)  # fmt: skip
    sched = Scheduler(cfg)
    sched.add(req("o0", [9, 9, 9, 9, 9], 30, priority=0))
    for i in range(5):
        sched.add(req(f"b{i}", [i + 1, 2, 3], 4, priority=BATCH))
    runner = runner_for(sched)
    step = sched.schedule()
    # one online sequence + two decode turns: a third batch sequence would only wait
    assert sorted(s.seq.seq_id for s in step.seqs) == ["b0", "b1", "o0"]
    sched.update(step, *runner.run(step))
    outputs, _ = drive(sched)
    assert all(outputs[f"b{i}"] == alone([i + 1, 2, 3], 4) for i in range(5))
    assert_all_free(sched)


def test_a_decode_turn_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="batch_decodes_beside_online"):
        SchedulerConfig(batch_decodes_beside_online=0)
