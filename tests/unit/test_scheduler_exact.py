"""The scheduler's two rules for batch invariance (core/schedule.py): a prompt cut by the step's
budget ends at a multiple of `chunk_align` (the host attention's tiles), and with
`replay_decodes` a preempted sequence feeds its generated tokens back one a step as decode
rows, as it first computed them, never inside a recompute chunk. Driven by the fake runner of
test_scheduler.py, whose tokens are a function of the context (so recomputation is checked)."""

from __future__ import annotations

import pytest

from batchmlx.core.schedule import chunk_length
from batchmlx.core.scheduler import Scheduler, SchedulerConfig
from tests.unit.test_scheduler import alone, drive, prompt_ids, request


def test_chunk_length_cuts_at_the_last_multiple_the_budget_reaches():
    assert chunk_length(0, 300, 400, 64, False) == 300  # the budget holds it: not cut
    assert chunk_length(0, 300, 200, 64, False) == 192
    assert chunk_length(100, 300, 200, 64, False) == 156  # ends at 256
    assert chunk_length(100, 300, 28, 64, False) == 28  # 100 + 28 reaches 128
    assert chunk_length(100, 300, 20, 64, False) == 0  # reaches no multiple: next step
    assert chunk_length(100, 300, 20, 64, True) == 20  # unless no prompt is in the step yet
    assert chunk_length(5, 300, 200, 1, False) == 200  # align 1: anywhere


def test_cut_prompts_end_on_the_alignment_and_give_the_tokens_of_a_prompt_alone():
    """Budget 20, alignment 8: b (50 tokens) is cut at 8, 24, 40 beside a's prompt and
    decodes; c waits while the budget left reaches no multiple of 8 from its start."""
    cfg = SchedulerConfig(block_size=4, num_blocks=128, max_prefill_tokens=20, chunk_align=8)
    sched = Scheduler(cfg)
    prompts = {"a": list(range(1, 11)), "b": list(range(20, 70)), "c": list(range(80, 110))}
    for rid, p in prompts.items():
        sched.add(request(rid, p, max_tokens=3))
    outputs, steps = drive(sched)
    assert [prompt_ids(s) for s in steps[:4]] == [
        [("a", 0, 10, True), ("b", 0, 8, False)],  # 10 left: b to 8, none for c
        [("b", 8, 16, False)],  # 19 left (a decodes): b to 24; 3 reach no 8 for c
        [("b", 24, 16, False)],
        [("b", 40, 10, True), ("c", 0, 8, False)],
    ]
    for s in (c for step in steps for c in step.seqs if not c.decode):
        assert s.samples or (s.start + s.num_new_tokens) % 8 == 0, s
    assert outputs == {rid: alone(p, 3) for rid, p in prompts.items()}


def test_a_budget_under_the_alignment_still_moves_the_first_prompt():
    cfg = SchedulerConfig(block_size=4, num_blocks=64, max_prefill_tokens=20, chunk_align=64)
    sched = Scheduler(cfg)
    sched.add(request("a", list(range(1, 51)), max_tokens=2))
    sched.add(request("b", list(range(60, 70)), max_tokens=2))
    outputs, steps = drive(sched)
    assert [prompt_ids(s) for s in steps[:3]] == [
        [("a", 0, 20, False)],  # the first prompt of the step, unaligned
        [("a", 20, 20, False)],
        [("a", 40, 10, True), ("b", 0, 10, True)],
    ]
    assert outputs["a"] == alone(list(range(1, 51)), 2)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_preempted_sequence_replays_its_generated_tokens_as_decode_rows(prefix_cache):
    """A pool too small for six sequences of 10-20 prompt and 12 new tokens: preemptions.
    Every position a sequence fed is fed as it was the first time: its prompt's in prompt
    chunks, each generated token's alone as a decode row. With the prefix cache, its full
    blocks come back as hits (past its prompt, too: then its admission is a decode row);
    without, every generated token is replayed."""
    cfg = SchedulerConfig(block_size=4, num_blocks=24, max_prefill_tokens=64,
                          enable_prefix_cache=prefix_cache, replay_decodes=True)  # fmt: skip
    sched = Scheduler(cfg)
    prompts = {f"r{i}": [i * 20 + j for j in range(10 + 2 * i)] for i in range(6)}
    for rid, p in prompts.items():
        sched.add(request(rid, p, max_tokens=12))
    outputs, steps = drive(sched)
    assert sched.stats.preemptions > 0 and sched.stats.replayed_tokens > 0
    fed: dict[tuple[str, int], set[bool]] = {}
    for step in steps:
        for s in step.seqs:
            assert not s.decode or s.num_new_tokens == 1
            for pos in range(s.start, s.start + s.num_new_tokens):
                fed.setdefault((s.seq.seq_id, pos), set()).add(s.decode)
    for (rid, pos), how in fed.items():
        assert how == {pos >= len(prompts[rid])}, (rid, pos, how)
    assert outputs == {rid: alone(p, 12) for rid, p in prompts.items()}


def test_without_replay_a_recompute_feeds_generated_tokens_in_a_chunk():
    """The rule above is what replay_decodes adds: off, the same workload recomputes
    generated tokens inside prompt chunks (the MLX path, not batch-invariant anyway)."""
    cfg = SchedulerConfig(block_size=4, num_blocks=24, max_prefill_tokens=64,
                          enable_prefix_cache=False)  # fmt: skip
    sched = Scheduler(cfg)
    prompts = {f"r{i}": [i * 20 + j for j in range(10 + 2 * i)] for i in range(6)}
    for rid, p in prompts.items():
        sched.add(request(rid, p, max_tokens=12))
    outputs, steps = drive(sched)
    chunked = [(s.seq.seq_id, s.start) for step in steps for s in step.seqs if not s.decode
               and s.start + s.num_new_tokens > len(prompts[s.seq.seq_id])]  # fmt: skip
    assert sched.stats.preemptions > 0 and chunked
    assert outputs == {rid: alone(p, 12) for rid, p in prompts.items()}


def test_blocks_past_a_prompts_last_whole_tile_are_hit_only_by_a_prompt_as_long():
    """With chunk_align 8 (block 4): a's 22-token prompt's whole tiles end at 16; its block
    16-19 (in its last, partial tile) is hashed with its length. b, as long, hits it; c,
    longer, whose own tile there would be whole, hits the first 16 tokens only."""
    cfg = SchedulerConfig(block_size=4, num_blocks=64, chunk_align=8, replay_decodes=True)
    sched = Scheduler(cfg)
    base = list(range(1, 23))
    sched.add(request("a", base, 2))
    drive(sched)
    b = sched.add(request("b", base[:21] + [99], 2))
    c = sched.add(request("c", base + [7, 8], 2))
    outputs, _ = drive(sched)
    assert (b.num_cached_tokens, c.num_cached_tokens) == (20, 16)
    assert outputs == {"b": alone(base[:21] + [99], 2), "c": alone(base + [7, 8], 2)}
