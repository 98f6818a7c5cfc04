"""The scheduler driven by a fake paged "model" on the CPU.

The fake runner writes every fed token into a fake KV store at (block id, offset) and, when a
sequence samples, reads its whole context back through the block table: a wrong block table,
a wrong prefix hit or a write into a shared block changes the context and is caught at once.
Its next token is a function of the context only, so a preempted and recomputed sequence must
produce exactly the tokens it produces alone.
"""

from __future__ import annotations

import random
import weakref

import pytest

from batchmlx.core.blocks import BlockPool
from batchmlx.core.request import CacheOutcome, GenerationRequest, SamplingParams
from batchmlx.core.scheduler import Scheduler, SchedulerConfig, SchedulerStep, StepKind
from batchmlx.core.sequence import Sequence, SequenceStatus
from benchmarks.prefix_trie import block_prefix_lower_bound


def next_token(context: list[int]) -> int:
    return (sum(context) * 31 + len(context)) % 50


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens))


class FakeRunner:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv: dict[tuple[int, int], int] = {}

    def run(self, step: SchedulerStep) -> tuple[dict[str, int], list[str]]:
        pool, bs = self.sched.pool, self.sched.config.block_size
        sampled: dict[str, int] = {}
        finished: list[str] = []
        for s in step.seqs:
            seq = s.seq
            for pos in range(s.start, s.start + s.num_new_tokens):
                block = pool.blocks[seq.block_table[pos // bs]]
                assert block.block_id != 0
                assert block.ref_count == 1 and block.block_hash is None  # private, not cached
                self.kv[(block.block_id, pos % bs)] = seq.token_ids[pos]
            if s.samples:
                end = s.start + s.num_new_tokens
                context = [self.kv[(seq.block_table[p // bs], p % bs)] for p in range(end)]
                assert context == seq.token_ids
                sampled[seq.seq_id] = next_token(context)
                if seq.num_generated + 1 >= seq.request.params.max_tokens:
                    finished.append(seq.seq_id)
        return sampled, finished


_RUNNERS: weakref.WeakKeyDictionary[Scheduler, FakeRunner] = weakref.WeakKeyDictionary()


def runner_for(sched: Scheduler) -> FakeRunner:
    """One fake KV store per scheduler, kept across drive() calls like the real one."""
    if sched not in _RUNNERS:
        _RUNNERS[sched] = FakeRunner(sched)
    return _RUNNERS[sched]


def check_invariants(sched: Scheduler) -> None:
    pool, bs = sched.pool, sched.config.block_size
    holders: dict[int, int] = {}
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * bs >= seq.num_computed_tokens
        for bid in seq.block_table:
            holders[bid] = holders.get(bid, 0) + 1
    free = set(pool.free_block_ids())
    for block in pool.blocks[1:]:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in free)
    assert 0 not in holders and pool.blocks[0].ref_count == 0
    assert len(sched.running) <= sched.config.max_batch_size


def drive(sched: Scheduler, max_steps: int = 10_000) -> tuple[dict[str, list[int]], list]:
    """Run to completion; returns generated tokens per id and the steps taken."""
    runner = runner_for(sched)
    outputs: dict[str, list[int]] = {}
    steps = []
    for _ in range(max_steps):
        step = sched.schedule()
        if step is None:
            break
        check_invariants(sched)
        steps.append(step)
        sampled, finished = runner.run(step)
        for seq in sched.update(step, sampled, finished) + step.finished:
            outputs[seq.seq_id] = seq.generated_token_ids
        check_invariants(sched)
    assert not sched.has_unfinished()
    assert sched.schedule() is None
    return outputs, steps


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4))
    sched.add(request("x", prompt, max_tokens))
    return drive(sched)[0]["x"]


def assert_all_free(sched: Scheduler) -> None:
    pool = sched.pool
    assert pool.num_free == pool.num_usable
    assert all(b.ref_count == 0 for b in pool.blocks)


def ids(step: SchedulerStep) -> list[tuple[str, int, int, bool]]:
    return [(s.seq.seq_id, s.start, s.num_new_tokens, s.samples) for s in step.seqs]


def prompt_ids(step: SchedulerStep) -> list[tuple[str, int, int, bool]]:
    """ids() of the prompt work only (a mixed step also carries the running decodes)."""
    return [(s.seq.seq_id, s.start, s.num_new_tokens, s.samples) for s in step.seqs if not s.decode]


def test_continuous_batching_refills_a_finished_slot_at_the_next_step():
    cfg = SchedulerConfig(max_batch_size=2, block_size=16, num_blocks=11, mixed_steps=False)
    sched = Scheduler(cfg)
    sched.add(request("a", [1, 2, 3, 4, 5], max_tokens=2))
    sched.add(request("b", [6, 7, 8, 9, 10], max_tokens=4))
    sched.add(request("c", [11, 12, 13], max_tokens=2))
    runner = runner_for(sched)
    trace = []
    while (step := sched.schedule()) is not None:
        trace.append((step.kind, ids(step)))
        sampled, finished = runner.run(step)
        done = sched.update(step, sampled, finished)
        trace.append([s.seq_id for s in done])
    P, D = StepKind.PREFILL, StepKind.DECODE
    assert trace == [
        (P, [("a", 0, 5, True), ("b", 0, 5, True)]),
        [],
        (D, [("a", 5, 1, True), ("b", 5, 1, True)]),
        ["a"],
        (P, [("c", 0, 3, True)]),  # a's slot refilled at once
        [],
        (D, [("b", 6, 1, True), ("c", 3, 1, True)]),
        ["c"],
        (D, [("b", 7, 1, True)]),
        ["b"],
    ]
    assert sched.stats.peak_running == 2
    assert_all_free(sched)


def test_running_sequences_never_exceed_max_batch_size():
    sched = Scheduler(SchedulerConfig(max_batch_size=3, block_size=4, num_blocks=64))
    for i in range(10):
        sched.add(request(f"r{i}", [i + 1] * (3 + i), max_tokens=2 + i % 3))
    outputs, steps = drive(sched)
    assert len(outputs) == 10
    assert max(len(s.seqs) for s in steps) == 3
    assert sched.stats.peak_running == 3
    assert_all_free(sched)


def test_long_prompt_is_chunked_under_the_prefill_budget():
    cfg = SchedulerConfig(block_size=16, num_blocks=64, max_prefill_tokens=32)
    sched = Scheduler(cfg)
    seq = sched.add(request("long", list(range(100)), max_tokens=2))
    outputs, steps = drive(sched)
    assert [(s.kind, ids(s)) for s in steps] == [
        (StepKind.PREFILL, [("long", 0, 32, False)]),
        (StepKind.PREFILL, [("long", 32, 32, False)]),
        (StepKind.PREFILL, [("long", 64, 32, False)]),
        (StepKind.PREFILL, [("long", 96, 4, True)]),
        (StepKind.DECODE, [("long", 100, 1, True)]),
    ]
    assert outputs["long"] == alone(list(range(100)), 2)
    assert seq.cache_outcome is CacheOutcome.MISS
    assert sched.stats.prefill_tokens_computed == 100


def test_the_prefill_budget_is_shared_and_a_cut_prompt_continues_first():
    cfg = SchedulerConfig(block_size=16, num_blocks=64, max_prefill_tokens=32, mixed_steps=False)
    sched = Scheduler(cfg)
    sched.add(request("a", list(range(20)), max_tokens=2))
    sched.add(request("b", list(range(100, 130)), max_tokens=2))
    sched.add(request("c", list(range(200, 210)), max_tokens=2))
    _, steps = drive(sched)
    assert [(s.kind, ids(s)) for s in steps[:3]] == [
        (StepKind.PREFILL, [("a", 0, 20, True), ("b", 0, 12, False)]),
        (StepKind.PREFILL, [("b", 12, 18, True), ("c", 0, 10, True)]),
        (StepKind.DECODE, [("a", 20, 1, True), ("b", 30, 1, True), ("c", 10, 1, True)]),
    ]


def test_prefix_cache_outcomes_like_the_reference_test():
    sched = Scheduler(SchedulerConfig(block_size=16, num_blocks=64))
    p1 = list(range(1, 41))  # 40 tokens: 2 blocks can hit, the last 8 tokens are computed
    p2 = list(range(500, 540))
    p3 = p1[:16] + list(range(900, 924))

    def one(rid: str, prompt: list[int]) -> Sequence:
        seq = sched.add(request(rid, prompt, max_tokens=3))
        assert drive(sched)[0][rid] == alone(prompt, 3)
        return seq

    first = one("1a", p1)
    assert (first.cache_outcome, first.num_cached_tokens) == (CacheOutcome.MISS, 0)
    same = one("1b", p1)
    assert (same.cache_outcome, same.num_cached_tokens) == (CacheOutcome.HIT, 32)
    other = one("1c", p2)
    assert (other.cache_outcome, other.num_cached_tokens) == (CacheOutcome.MISS, 0)
    partial = one("1p", p3)
    assert (partial.cache_outcome, partial.num_cached_tokens) == (CacheOutcome.PREFIX_HIT, 16)
    back = one("1d", p1)
    assert (back.cache_outcome, back.num_cached_tokens) == (CacheOutcome.HIT, 32)
    stats = sched.stats
    assert (stats.hits, stats.misses, stats.prefix_hits) == (2, 2, 1)
    assert stats.prefill_tokens_reused == 32 + 16 + 32
    assert stats.prefill_tokens_computed == 40 + 8 + 40 + 24 + 8
    assert_all_free(sched)


def test_concurrent_hits_share_blocks_with_ref_counts():
    sched = Scheduler(SchedulerConfig(block_size=16, num_blocks=11))
    prompt = list(range(1, 41))
    sched.add(request("warm", prompt, max_tokens=1))
    drive(sched)
    # Freed: block 3 (tail, uncached) to the front; cached 2 then 1 to the back.
    assert sched.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    a = sched.add(request("a", prompt, max_tokens=2))
    b = sched.add(request("b", prompt, max_tokens=2))
    step = sched.schedule()
    assert ids(step) == [("a", 32, 8, True), ("b", 32, 8, True)]
    assert a.block_table == [1, 2, 3]
    assert b.block_table == [1, 2, 4]
    assert [sched.pool.blocks[i].ref_count for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    runner = runner_for(sched)
    sampled, finished = runner.run(step)
    sched.update(step, sampled, finished)
    while (step := sched.schedule()) is not None:
        sched.update(step, *runner.run(step))
    assert_all_free(sched)


def test_collisions_never_reuse_another_prompts_blocks():
    pool = BlockPool(11, 16, hash_fn=lambda parent, toks: 42)  # every block collides
    sched = Scheduler(SchedulerConfig(block_size=16, num_blocks=11), pool)
    p1, p2 = list(range(1, 41)), list(range(101, 141))
    sched.add(request("a", p1, max_tokens=3))
    drive(sched)
    b = sched.add(request("b", p2, max_tokens=3))
    assert drive(sched)[0]["b"] == alone(p2, 3)  # the runner checks every context it reads
    assert (b.cache_outcome, b.num_cached_tokens) == (CacheOutcome.MISS, 0)


def test_prefix_grouping_computes_a_shared_prefix_once():
    system = list(range(1000, 1100))  # 100 tokens: 6 full blocks + 4
    prompts = {
        "a": system + list(range(1, 21)),
        "c": list(range(5000, 5050)),  # unrelated: admitted with a
        "b": system + list(range(30, 60)),
        "d": system + [7, 8, 9, 10, 11],
    }
    bound = block_prefix_lower_bound(list(prompts.values()), 16)
    assert bound == 213

    sched = Scheduler(SchedulerConfig(block_size=16, num_blocks=128))
    seqs = {rid: sched.add(request(rid, p, max_tokens=3)) for rid, p in prompts.items()}
    outputs, steps = drive(sched)
    assert ids(steps[0]) == [("a", 0, 120, True), ("c", 0, 50, True)]  # b, d wait one step
    assert prompt_ids(steps[1]) == [("b", 96, 34, True), ("d", 96, 9, True)]
    assert sched.stats.prefill_tokens_computed == bound
    assert sched.stats.prefill_tokens_reused == 2 * 96
    assert seqs["b"].cache_outcome is CacheOutcome.PREFIX_HIT
    assert seqs["d"].cache_outcome is CacheOutcome.HIT
    for rid, p in prompts.items():
        assert outputs[rid] == alone(p, 3)

    ungrouped = Scheduler(SchedulerConfig(block_size=16, num_blocks=128, prefix_grouping=False))
    for rid, p in prompts.items():
        ungrouped.add(request(rid, p, max_tokens=3))
    assert drive(ungrouped)[0] == outputs
    assert ungrouped.stats.prefill_tokens_computed == 120 + 50 + 130 + 105  # prefix 3 times


def test_a_prompt_ending_on_a_block_boundary_feeds_a_longer_one():
    p = list(range(1, 33))
    q = p + list(range(100, 108))
    sched = Scheduler(SchedulerConfig(block_size=16, num_blocks=64))
    sched.add(request("p", p, max_tokens=2))
    seq_q = sched.add(request("q", q, max_tokens=2))
    _, steps = drive(sched)
    assert ids(steps[0]) == [("p", 0, 32, True)]  # q waits for p's blocks 0 and 1
    assert prompt_ids(steps[1]) == [("q", 32, 8, True)]
    assert seq_q.cache_outcome is CacheOutcome.HIT
    assert sched.stats.prefill_tokens_computed == block_prefix_lower_bound([p, q], 16) == 40


def test_grouping_places_later_arrivals_next_to_their_prefix_group():
    system = list(range(1000, 1032))
    sched = Scheduler(SchedulerConfig(block_size=16, num_blocks=128, max_batch_size=2))
    sched.add(request("s1", system + [1, 2], max_tokens=1))
    sched.add(request("u1", list(range(1, 40)), max_tokens=1))
    sched.add(request("u2", list(range(100, 140)), max_tokens=1))
    sched.add(request("s2", system + [3, 4], max_tokens=1))
    order = [seq.seq_id for seq in sched.waiting]
    assert order == ["s1", "s2", "u1", "u2"]
    assert len(sched.waiting) == 4


def test_preemption_under_a_tiny_pool_recomputes_the_same_tokens():
    cfg = SchedulerConfig(block_size=4, num_blocks=5, max_batch_size=3)  # 4 usable blocks
    sched = Scheduler(cfg)
    prompts = {f"r{i}": [10 * i + k for k in range(1, 7)] for i in range(3)}
    seqs = {rid: sched.add(request(rid, p, max_tokens=10)) for rid, p in prompts.items()}
    outputs, steps = drive(sched)
    for rid, p in prompts.items():
        assert outputs[rid] == alone(p, 10)
        assert len(outputs[rid]) == 10
    assert sched.stats.preemptions > 0
    assert sum(s.num_preemptions for s in seqs.values()) == sched.stats.preemptions
    assert any(step.preempted for step in steps)
    assert all(s.cache_outcome is CacheOutcome.MISS for s in seqs.values())
    assert not any(step.finished for step in steps)  # none ended by the scheduler itself
    assert sched.stats.peak_blocks_in_use <= 4
    assert_all_free(sched)


def test_preempted_sequence_goes_back_to_the_front_and_keeps_its_outcome():
    cfg = SchedulerConfig(block_size=4, num_blocks=5, max_batch_size=2)
    sched = Scheduler(cfg)
    a = sched.add(request("a", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=6))  # 2 full blocks
    b = sched.add(request("b", [9, 8, 7, 6, 5, 4, 3, 2], max_tokens=6))  # 2 full blocks
    c = sched.add(request("c", [5, 5, 5], max_tokens=1))
    runner = runner_for(sched)
    step = sched.schedule()
    assert ids(step) == [("a", 0, 8, True), ("b", 0, 8, True)]
    sched.update(step, *runner.run(step))
    assert sched.pool.num_cached == 4  # the full prompt blocks, registered after the step
    step = sched.schedule()  # both need a third block: b, the most recent, is preempted
    assert step.kind is StepKind.DECODE
    assert ids(step) == [("a", 8, 1, True)]
    assert step.preempted == [b]
    assert (b.status, b.num_computed_tokens, b.block_table) == (SequenceStatus.WAITING, 0, [])
    assert b.num_preemptions == 1 and b.num_generated == 1
    assert [seq.seq_id for seq in sched.waiting] == ["b", "c"]
    # b's cached blocks went to the back tail first (4, 3): a takes b's tail block.
    assert a.block_table == [1, 2, 4]
    assert sched.pool.free_block_ids() == [3]
    sched.update(step, *runner.run(step))
    outputs, _ = drive(sched)
    assert outputs["b"] == alone([9, 8, 7, 6, 5, 4, 3, 2], 6)
    assert b.cache_outcome is CacheOutcome.MISS
    assert c.status is SequenceStatus.FINISHED
    assert_all_free(sched)


def test_a_sequence_the_pool_cannot_hold_alone_ends_with_length():
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=3))  # 8 token slots
    seq = sched.add(request("big", [1, 2, 3, 4, 5, 6], max_tokens=10))
    outputs, steps = drive(sched)
    assert steps[-1].finished == [seq]  # ended by the scheduler: the engine reports LENGTH
    assert seq.status is SequenceStatus.FINISHED
    # Positions 0..7 fed; the tokens sampled at 5, 6 and 7 are kept.
    assert outputs["big"] == alone([1, 2, 3, 4, 5, 6], 10)[:3]
    assert_all_free(sched)


def test_a_prompt_longer_than_the_pool_is_chunked_then_ends_with_length():
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=3))
    seq = sched.add(request("huge", list(range(1, 21)), max_tokens=3))
    outputs, steps = drive(sched)
    assert ids(steps[0]) == [("huge", 0, 8, False)]
    assert steps[-1].finished == [seq]  # ended by the scheduler: the engine reports LENGTH
    assert outputs["huge"] == []
    assert_all_free(sched)


def test_abort_frees_running_and_removes_waiting_sequences():
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=11, max_batch_size=1))
    a = sched.add(request("a", [1, 2, 3, 4, 5], max_tokens=5))
    sched.add(request("b", [6, 7, 8], max_tokens=5))
    step = sched.schedule()
    assert a.block_table == [1, 2]
    assert sched.abort("b").status is SequenceStatus.FINISHED
    assert sched.abort("a") is a
    assert sched.abort("a") is None
    assert sched.update(step, {"a": 1}, []) == []  # the step's outcome for an aborted seq
    assert not sched.has_unfinished()
    assert sched.schedule() is None
    assert_all_free(sched)


def test_disabled_prefix_cache_computes_everything():
    cfg = SchedulerConfig(block_size=16, num_blocks=64, enable_prefix_cache=False)
    sched = Scheduler(cfg)
    p = list(range(1, 41))
    for rid in ("a", "b"):
        sched.add(request(rid, p, max_tokens=2))
        drive(sched)
    assert sched.stats.prefill_tokens_computed == 80
    assert sched.stats.misses == 2
    assert sched.pool.num_cached == 0


def test_duplicate_ids_and_empty_prompts_are_bugs():
    sched = Scheduler(SchedulerConfig())
    sched.add(request("a", [1]))
    with pytest.raises(ValueError):
        sched.add(request("a", [2]))
    with pytest.raises(ValueError):
        sched.add(request("e", []))
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(block_size=16), BlockPool(11, 8))


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_match_isolated_runs(seed: int, mixed: bool):
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 100) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    cfg = SchedulerConfig(
        block_size=4,
        num_blocks=rng.choice([6, 9, 16, 40]),
        max_batch_size=rng.choice([1, 2, 4, 8]),
        max_prefill_tokens=rng.choice([5, 16, 64]),
        prefix_grouping=rng.random() < 0.7,
        mixed_steps=mixed,
    )
    sched = Scheduler(cfg)
    jobs = {}
    for i in range(14):
        prompt = rng.choice(systems)[: rng.randrange(1, 40)] + [
            rng.randrange(1, 100) for _ in range(rng.randrange(0, 6))
        ]
        if not prompt:
            prompt = [1]
        jobs[f"r{i}"] = (prompt, rng.randrange(1, 8))
        sched.add(request(f"r{i}", prompt, jobs[f"r{i}"][1]))
    outputs, steps = drive(sched)
    for step in steps:  # the budget holds; only decodes (never starved) may go past it
        decodes = sum(s.decode for s in step.seqs)
        prompt = sum(s.num_new_tokens for s in step.seqs if not s.decode)
        assert prompt == 0 or prompt + decodes <= cfg.max_prefill_tokens
        assert decodes == 0 or mixed or prompt == 0
    usable = cfg.num_blocks - 1
    for rid, (prompt, max_tokens) in jobs.items():
        seq_tokens = outputs[rid]
        full = alone(prompt, max_tokens)
        if len(prompt) + max_tokens - 1 <= usable * cfg.block_size:
            assert seq_tokens == full
        else:  # ended by LENGTH: a prefix of the full output
            assert seq_tokens == full[: len(seq_tokens)]
    assert sched.stats.peak_blocks_in_use <= usable
    assert_all_free(sched)


# -- mixed steps: decodes never wait for a prefill ---------------------------------------------


def test_mixed_steps_refill_a_slot_while_the_others_decode():
    sched = Scheduler(SchedulerConfig(max_batch_size=2, block_size=16, num_blocks=11))
    sched.add(request("a", [1, 2, 3, 4, 5], max_tokens=2))
    sched.add(request("b", [6, 7, 8, 9, 10], max_tokens=4))
    sched.add(request("c", [11, 12, 13], max_tokens=2))
    runner = runner_for(sched)
    trace = []
    while (step := sched.schedule()) is not None:
        trace.append((step.kind, ids(step)))
        sampled, finished = runner.run(step)
        trace.append([s.seq_id for s in sched.update(step, sampled, finished)])
    P, D, M = StepKind.PREFILL, StepKind.DECODE, StepKind.MIXED
    assert trace == [
        (P, [("a", 0, 5, True), ("b", 0, 5, True)]),
        [],
        (D, [("a", 5, 1, True), ("b", 5, 1, True)]),
        ["a"],
        (M, [("b", 6, 1, True), ("c", 0, 3, True)]),  # b decodes while c's prompt runs
        [],
        (D, [("b", 7, 1, True), ("c", 3, 1, True)]),
        ["b", "c"],
    ]
    stats = sched.stats
    assert (stats.prefill_steps, stats.decode_steps, stats.mixed_steps) == (1, 2, 1)
    assert (stats.prefill_tokens_computed, stats.decode_tokens) == (13, 5)
    assert_all_free(sched)


def decode_gaps(mixed: bool) -> tuple[dict[str, int], list[SchedulerStep], dict[str, list[int]]]:
    """Eight sequences decode, then a 300-token prompt arrives under a 64-token budget.
    Returns the longest run of steps each decoding sequence went without a token."""
    cfg = SchedulerConfig(block_size=16, num_blocks=128, max_prefill_tokens=64, mixed_steps=mixed)
    sched = Scheduler(cfg)
    for i in range(8):
        sched.add(request(f"d{i}", [i + 1] * (5 + i), max_tokens=30))
    runner = runner_for(sched)
    outputs: dict[str, list[int]] = {}
    steps: list[SchedulerStep] = []
    gaps = {f"d{i}": 0 for i in range(8)}
    since = dict.fromkeys(gaps, 0)
    for n in range(200):
        if n == 3:  # all eight are decoding by now
            sched.add(request("long", list(range(100, 400)), max_tokens=3))
        step = sched.schedule()
        if step is None:
            break
        steps.append(step)
        fed = {s.seq.seq_id for s in step.seqs}
        for rid in since:
            if sched.get(rid) is not None and rid not in outputs:
                since[rid] = 0 if rid in fed else since[rid] + 1
                gaps[rid] = max(gaps[rid], since[rid])
        sampled, finished = runner.run(step)
        for seq in sched.update(step, sampled, finished):
            outputs[seq.seq_id] = seq.generated_token_ids
    assert not sched.has_unfinished()
    return gaps, steps, outputs


def test_a_long_prompt_arriving_while_eight_decode_never_stalls_them():
    gaps, steps, outputs = decode_gaps(mixed=True)
    assert all(gap == 0 for gap in gaps.values())  # a token every step
    chunks = [s for step in steps for s in step.seqs if s.seq.seq_id == "long"]
    assert [c.num_new_tokens for c in chunks[:-2]] == [56, 56, 56, 56, 56, 20]  # 64 - 8 decodes
    for step in steps:
        assert sum(s.num_new_tokens for s in step.seqs) <= 64
    assert any(step.kind is StepKind.MIXED for step in steps)
    # the same tokens as unmixed steps, which do stall the decodes for the prompt's 5 chunks
    old_gaps, _, old_outputs = decode_gaps(mixed=False)
    assert max(old_gaps.values()) == 5
    assert outputs == old_outputs
    isolated = Scheduler(SchedulerConfig(block_size=16, num_blocks=128))
    isolated.add(request("long", list(range(100, 400)), max_tokens=3))
    assert outputs["long"] == drive(isolated)[0]["long"]
    assert outputs["d7"] == alone([8] * 12, 30)
