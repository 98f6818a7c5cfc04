"""Online requests outrank batch work inside one running batch."""

from __future__ import annotations

from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.core.scheduler import Scheduler, SchedulerConfig
from tests.unit.test_scheduler import alone, assert_all_free, drive, runner_for


def req(rid: str, prompt: list[int], max_tokens: int, priority: int) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return GenerationRequest(rid, prompt, params, priority=priority)


def test_an_online_request_takes_a_full_batch_slot_at_once():
    sched = Scheduler(SchedulerConfig(max_batch_size=2, block_size=4, num_blocks=64))
    sched.add(req("b0", [1, 2, 3, 4, 5], 12, priority=1))
    sched.add(req("b1", [6, 7, 8, 9], 12, priority=1))
    runner = runner_for(sched)
    for _ in range(3):  # both batch requests admitted and decoding
        step = sched.schedule()
        sched.update(step, *runner.run(step))
    assert [s.seq_id for s in sched.running] == ["b0", "b1"]

    sched.add(req("o0", [9, 9, 9], 3, priority=0))
    step = sched.schedule()
    # the most recently admitted batch request gave its slot; the online one runs this step
    assert [s.seq_id for s in step.preempted] == ["b1"]
    assert [s.seq.seq_id for s in step.seqs if not s.decode] == ["o0"]
    assert [s.seq.seq_id for s in step.seqs if s.decode] == ["b0"]  # b0 goes on decoding
    sched.update(step, *runner.run(step))

    outputs, _ = drive(sched)
    # the preempted batch request was recomputed and produced the same tokens
    assert outputs["b1"] == alone([6, 7, 8, 9], 12)
    assert outputs["o0"] == alone([9, 9, 9], 3)
    assert_all_free(sched)


def test_waiting_online_requests_are_admitted_before_older_batch_work():
    sched = Scheduler(SchedulerConfig(max_batch_size=1, block_size=4, num_blocks=64))
    sched.add(req("b0", [1, 2, 3], 2, priority=1))
    sched.add(req("b1", [4, 5, 6], 2, priority=1))
    sched.add(req("o0", [7, 8, 9], 2, priority=0))
    order = []
    while (step := sched.schedule()) is not None:
        order += [s.seq.seq_id for s in step.seqs if s.seq.seq_id not in order]
        sched.update(step, *runner_for(sched).run(step))
    assert order == ["o0", "b0", "b1"]


def test_the_running_limit_bounds_batch_work_and_online_requests_bypass_it():
    sched = Scheduler(SchedulerConfig(max_batch_size=4, block_size=4, num_blocks=64))
    sched.running_limit = 2  # what the width controller set
    for i in range(4):
        sched.add(req(f"b{i}", [1 + i, 2, 3], 6, priority=1))
    runner = runner_for(sched)
    step = sched.schedule()
    assert [s.seq.seq_id for s in step.seqs] == ["b0", "b1"]
    sched.update(step, *runner.run(step))

    sched.add(req("o0", [9, 9, 9], 3, priority=0))
    sched.add(req("o1", [8, 8, 8], 3, priority=0))
    step = sched.schedule()
    # above the running limit but within the hard cap: admitted at once, nobody preempted, and
    # the running batch work keeps decoding in the same (mixed) step
    assert [s.seq.seq_id for s in step.seqs if not s.decode] == ["o0", "o1"]
    assert [s.seq.seq_id for s in step.seqs if s.decode] == ["b0", "b1"]
    assert step.preempted == []
    assert sched.online_running() == 2
    sched.update(step, *runner.run(step))

    sched.running_limit = 4  # widening admits the waiting batch work up to the hard cap only
    outputs, _ = drive(sched)
    assert outputs["b3"] == alone([4, 2, 3], 6)
    assert sched.stats.peak_running == 4
    assert sched.stats.urgent_preemptions == 0
    assert_all_free(sched)


def test_while_online_work_runs_batch_prompts_take_a_small_share_of_a_step():
    """A step carrying online work feeds at most batch_prefill_beside_online batch prompt
    tokens (the rest of the step's budget is the online prompts' and the decodes'); once the
    online work is done, batch prompts take whole steps again. Every output is unchanged."""
    cfg = SchedulerConfig(max_batch_size=8, block_size=4, num_blocks=256, max_prefill_tokens=64,
                          batch_prefill_beside_online=8, online_linger_s=0.0)  # fmt: skip
    sched = Scheduler(cfg)
    runner = runner_for(sched)
    long = [list(range(1 + i, 61 + i)) for i in range(3)]  # 60-token batch prompts
    sched.add(req("b0", long[0], 4, priority=1))
    step = sched.schedule()  # alone: the whole budget
    assert sum(s.num_new_tokens for s in step.seqs) == 60
    sched.update(step, *runner.run(step))
    sched.add(req("o0", [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3, 2, 1], 6, priority=0))
    sched.add(req("b1", long[1], 4, priority=1))
    sched.add(req("b2", long[2], 4, priority=1))
    batch_tokens = []
    while any(s.request.priority == 0 for s in sched.running) or sched.get("o0") is not None:
        step = sched.schedule()
        online = [s for s in step.seqs if s.seq.request.priority == 0 and not s.decode]
        batch = [s for s in step.seqs if s.seq.request.priority == 1 and not s.decode]
        batch_tokens.append(sum(s.num_new_tokens for s in batch))
        if online:  # the online prompt was not cut to make room for batch prompts
            assert online[0].num_new_tokens == 18
        sched.update(step, *runner.run(step))
    assert max(batch_tokens) <= 8 and sum(batch_tokens) > 0  # batch work went on, slowly
    step = sched.schedule()  # the online request is done: batch prompts take whole steps
    assert sum(s.num_new_tokens for s in step.seqs if not s.decode) > 8
    sched.update(step, *runner.run(step))
    outputs, _ = drive(sched)
    assert outputs["b1"] == alone(long[1], 4) and outputs["b2"] == alone(long[2], 4)
    assert_all_free(sched)


def test_no_batch_prefill_beside_online_work_when_its_share_is_zero():
    cfg = SchedulerConfig(max_batch_size=8, block_size=4, num_blocks=256, max_prefill_tokens=64,
                          batch_prefill_beside_online=0, online_linger_s=0.0)  # fmt: skip
    sched = Scheduler(cfg)
    runner = runner_for(sched)
    sched.add(req("o0", [5, 6, 7, 8, 9], 3, priority=0))
    sched.add(req("b0", [1, 2, 3, 4], 2, priority=1))
    seen = []
    while (step := sched.schedule()) is not None:
        seen.append({s.seq.seq_id for s in step.seqs})
        sched.update(step, *runner.run(step))
    # b0 starts only once o0 has finished
    first_b0 = next(i for i, ids in enumerate(seen) if "b0" in ids)
    assert all("o0" not in ids for ids in seen[first_b0:])
    assert_all_free(sched)


def _prompt_tokens(step, priority: int) -> int:
    return sum(s.num_new_tokens for s in step.seqs if not s.decode
               and s.seq.request.priority == priority)  # fmt: skip


def test_an_engine_serving_online_bounds_batch_prefill_before_any_online_request_comes():
    """In serve an online request can arrive during any step and waits for it to end, so
    every step feeds at most batch_prefill_beside_online batch prompt tokens; one that
    arrives gets its whole prompt in the next step. Outputs are unchanged."""
    cfg = SchedulerConfig(max_batch_size=8, block_size=4, num_blocks=256, max_prefill_tokens=64,
                          batch_prefill_beside_online=12, serves_online=True)  # fmt: skip
    sched = Scheduler(cfg)
    runner = runner_for(sched)
    long = [list(range(1 + i, 41 + i)) for i in range(3)]  # 40-token batch prompts
    for i, p in enumerate(long):
        sched.add(req(f"b{i}", p, 4, priority=1))
    fed = []
    for _ in range(3):  # no online work anywhere yet
        step = sched.schedule()
        fed.append(_prompt_tokens(step, 1))
        sched.update(step, *runner.run(step))
    assert fed == [12, 12, 12]  # 120 tokens wait: one whole-budget step would have taken 64
    online = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8]  # 20 tokens > 12
    sched.add(req("o0", online, 3, priority=0))
    step = sched.schedule()
    assert _prompt_tokens(step, 0) == 20 and _prompt_tokens(step, 1) <= 12
    sched.update(step, *runner.run(step))
    outputs, steps = drive(sched)
    assert max(_prompt_tokens(s, 1) for s in steps) == 12
    assert outputs["o0"] == alone(online, 3)
    assert all(outputs[f"b{i}"] == alone(p, 4) for i, p in enumerate(long))
    assert_all_free(sched)


def test_without_online_requests_batch_prompts_take_whole_steps():
    """A batch-only engine (worker, submit --wait), and serve with the bound at 0 while no
    online work runs: the step's whole token budget."""
    for cfg in (
        SchedulerConfig(max_batch_size=8, block_size=4, num_blocks=256, max_prefill_tokens=64,
                        batch_prefill_beside_online=12),
        SchedulerConfig(max_batch_size=8, block_size=4, num_blocks=256, max_prefill_tokens=64,
                        batch_prefill_beside_online=0, serves_online=True),
    ):  # fmt: skip
        sched = Scheduler(cfg)
        for i in range(3):
            sched.add(req(f"b{i}", list(range(1 + i, 41 + i)), 4, priority=1))
        step = sched.schedule()
        assert _prompt_tokens(step, 1) == 64
        sched.update(step, *runner_for(sched).run(step))
        drive(sched)
        assert_all_free(sched)


def test_in_an_engine_serving_online_the_bound_counts_the_steps_decodes():
    """Without online work, serve's bound is on a step's rows: batch prompts fill it up to
    batch_prefill_beside_online less its decodes (a step's time follows its rows: the online
    request that arrives waits for all of them), at least a floor's worth (16), so admissions
    go on beside a wide running batch. Outputs are unchanged."""
    cfg = SchedulerConfig(max_batch_size=64, block_size=4, num_blocks=512,
                          max_prefill_tokens=256, batch_prefill_beside_online=40,
                          serves_online=True)  # fmt: skip
    sched = Scheduler(cfg)
    runner = runner_for(sched)
    short = {f"s{i}": [1 + i, 2, 3] for i in range(10)}
    long = {f"b{i}": list(range(1 + i, 61 + i)) for i in range(3)}
    seqs = {rid: sched.add(req(rid, prompt, 30, priority=1)) for rid, prompt in short.items()}
    step = sched.schedule()  # the 10 short prompts (30 tokens)
    sched.update(step, *runner.run(step))
    seqs |= {rid: sched.add(req(rid, prompt, 4, priority=1)) for rid, prompt in long.items()}
    step = sched.schedule()
    assert sum(s.decode for s in step.seqs) == 10
    assert _prompt_tokens(step, 1) == 30  # 40 rows less the 10 decodes (main: 40)
    sched.update(step, *runner.run(step))
    for rid, prompt in {f"w{i}": [50 + i, 2, 3] for i in range(40)}.items():
        sched.add(req(rid, prompt, 30, priority=1))
    rows = []
    while len(rows) < 12 and (step := sched.schedule()) is not None:
        decodes = sum(s.decode for s in step.seqs)
        rows.append((decodes, _prompt_tokens(step, 1)))
        sched.update(step, *runner.run(step))
    assert all(p <= max(40 - d, 16) for d, p in rows)
    assert any(d > 24 and p == 16 for d, p in rows)  # the floor beside a wide batch
    drive(sched)
    assert all(seqs[r].generated_token_ids == alone(p, 30) for r, p in short.items())
    assert all(seqs[r].generated_token_ids == alone(p, 4) for r, p in long.items())
    assert_all_free(sched)
