"""The bounds a step takes beside online work hold for online_linger_s after the last online
request ended (core/online_window.py): a client's next request finds a narrow step, not the
whole batch and its prompts (issue 49). The clock is injected: no sleeping."""

from __future__ import annotations

from batchmlx.core.online_window import OnlineWindow
from batchmlx.core.priority import engine_priority
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.core.scheduler import Scheduler, SchedulerConfig, SchedulerStep
from tests.unit.test_scheduler import alone, assert_all_free, drive, runner_for

BATCH = engine_priority(0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def req(rid: str, prompt: list[int], max_tokens: int, priority: int) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                             priority=priority)  # fmt: skip


def test_the_window_holds_for_linger_s_after_the_last_online_step():
    clock = Clock()
    window = OnlineWindow(1.0, clock)
    assert window.step(False) is False  # no online work yet
    assert window.step(True) is True
    clock.now += 0.99
    assert window.step(False) is True
    clock.now += 0.02
    assert window.step(False) is False
    assert OnlineWindow(0.0, clock).step(False) is False


def _decodes(step: SchedulerStep) -> int:
    return sum(s.decode for s in step.seqs)


def _batch_prompt(step: SchedulerStep) -> int:
    return sum(s.num_new_tokens for s in step.seqs if not s.decode and s.seq.request.priority)


def test_after_online_work_batch_prompts_and_admissions_stay_bounded_for_the_linger():
    clock = Clock()
    cfg = SchedulerConfig(max_batch_size=16, block_size=4, num_blocks=512, max_prefill_tokens=64,
                          batch_decodes_beside_online=3, batch_prefill_beside_online=8,
                          online_linger_s=1.0)  # fmt: skip
    sched = Scheduler(cfg, clock=clock)
    runner = runner_for(sched)
    sched.add(req("o0", [9, 9, 9], 2, priority=0))
    prompts = {f"b{i}": [i + 1, 2, 3, 4, 5, 6, 7, 8, 9, 10] for i in range(8)}
    for rid, p in prompts.items():
        sched.add(req(rid, p, 40, priority=BATCH))
    steps = []
    while sched.get("o0") is not None or clock.now < 100.0 + 1.0:  # o0, then its linger
        step = sched.schedule()
        steps.append(step)
        sched.update(step, *runner.run(step))
        clock.now += 0.1
    assert len(steps) > 8  # the linger took steps of its own
    assert all(_decodes(s) <= 3 and _batch_prompt(s) <= 8 for s in steps)
    assert len(sched.running) <= 3  # admissions stopped at the decode turns
    clock.now += 0.5  # past it: the waiting batch's prompts take a whole step
    step = sched.schedule()
    assert _batch_prompt(step) > 8
    sched.update(step, *runner.run(step))
    outputs, _ = drive(sched)
    assert all(outputs[rid] == alone(p, 40) for rid, p in prompts.items())
    assert_all_free(sched)


def test_an_online_request_in_the_linger_finds_a_narrow_step():
    """Decode turns hold in the linger: the batch's whole width is not decoded while the next
    request is on its way; it comes, and the bounds simply go on."""
    clock = Clock()
    cfg = SchedulerConfig(max_batch_size=16, block_size=4, num_blocks=512,
                          batch_decodes_beside_online=2, online_linger_s=1.0)  # fmt: skip
    sched = Scheduler(cfg, clock=clock)
    runner = runner_for(sched)
    for i in range(6):
        sched.add(req(f"b{i}", [i + 1, 2, 3], 40, priority=BATCH))
    for _ in range(2):  # no online work: all six admitted and decoding
        step = sched.schedule()
        sched.update(step, *runner.run(step))
    assert len(sched.running) == 6
    sched.add(req("o0", [9, 9, 9], 2, priority=0))
    widths = []
    for _ in range(6):  # o0 runs and ends; then the linger, then past it
        step = sched.schedule()
        widths.append(sum(s.decode and s.seq.request.priority > 0 for s in step.seqs))
        sched.update(step, *runner.run(step))
        clock.now += 0.3
    assert widths == [2, 2, 2, 2, 2, 6]  # o0: 2 steps; the linger: 3 steps (0.9 s); then all
    assert sched.stats.preemptions == 0  # paused batch sequences keep their blocks
    drive(sched)
    assert_all_free(sched)


def test_with_no_batch_prefill_beside_online_the_linger_does_not_hold_batch_prompts():
    """batch_prefill_beside_online=0 stops batch prompts while online work is there; in the
    linger they run (else no step could run at all until it ends)."""
    clock = Clock()  # never moves: the whole run is in the linger
    cfg = SchedulerConfig(max_batch_size=8, block_size=4, num_blocks=256,
                          batch_prefill_beside_online=0, online_linger_s=1.0)  # fmt: skip
    sched = Scheduler(cfg, clock=clock)
    sched.add(req("o0", [5, 6, 7, 8, 9], 3, priority=0))
    sched.add(req("b0", [1, 2, 3, 4], 2, priority=BATCH))
    outputs, steps = drive(sched)
    first_b0 = next(i for i, s in enumerate(steps) if "b0" in {x.seq.seq_id for x in s.seqs})
    assert all("o0" not in {x.seq.seq_id for x in s.seqs} for s in steps[first_b0:])
    assert outputs["b0"] == alone([1, 2, 3, 4], 2)
    assert_all_free(sched)
