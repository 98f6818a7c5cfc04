"""The KV-cache manager alone: exact block ids, ref counts, hashes and free-queue order
(a pool of 11 blocks of 16 tokens), no scheduler."""

from __future__ import annotations

from batchmlx.core.blocks import BlockPool, hash_block
from batchmlx.core.kv_manager import KVCacheManager, blocks_for
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.core.sequence import Sequence

BS = 16


def make(enable: bool = True) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks=11, block_size=BS)
    return pool, KVCacheManager(pool, enable_prefix_cache=enable)


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(GenerationRequest(rid, tokens, SamplingParams()), arrival=0)


def run_prompt(kv: KVCacheManager, s: Sequence) -> None:
    """Admit s without hits and compute its whole prompt, as the scheduler would."""
    assert kv.admit(s, kv.cached_prefix(s), s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    kv.register_full_blocks(s)


def test_blocks_for_rounds_up():
    assert [blocks_for(n, BS) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_hashes_are_chained_and_memoized_on_the_sequence():
    _, kv = make()
    s = seq(list(range(40)))
    h = kv.hashes(s, 2)
    assert h == [hash_block(None, range(16)), hash_block(h[0], range(16, 32))]
    assert s.block_hashes is h
    assert kv.hashes(s, 1) == h  # never shortened


def test_admit_without_hits_takes_blocks_in_free_queue_order():
    pool, kv = make()
    s = seq(list(range(40)))
    assert kv.cached_prefix(s) == []
    assert kv.admit(s, [], 40)
    assert s.block_table == [1, 2, 3]
    assert s.num_registered_blocks == 0
    assert [pool.blocks[i].ref_count for i in (1, 2, 3)] == [1, 1, 1]
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 10]


def test_registration_caches_only_full_computed_blocks():
    pool, kv = make()
    s = seq(list(range(40)))
    kv.admit(s, [], 40)
    s.num_computed_tokens = 20
    kv.register_full_blocks(s)
    assert s.num_registered_blocks == 1
    assert pool.num_cached == 1 and pool.blocks[1].is_cached and not pool.blocks[2].is_cached
    s.num_computed_tokens = 40
    kv.register_full_blocks(s)
    assert s.num_registered_blocks == 2
    assert pool.num_cached == 2 and not pool.blocks[3].is_cached  # 8 tokens: not full


def test_registration_is_off_without_prefix_cache():
    pool, kv = make(enable=False)
    s = seq(list(range(40)))
    run_prompt(kv, s)
    assert pool.num_cached == 0 and s.num_registered_blocks == 0
    assert kv.cached_prefix(seq(list(range(40)), "b")) == []


def test_second_sequence_hits_the_shared_prefix_and_shares_ref_counted_blocks():
    pool, kv = make()
    a = seq(list(range(40)), "a")
    run_prompt(kv, a)  # blocks 1, 2 cached; 3 private
    b = seq(list(range(32)) + [99] * 8, "b")
    hits = kv.cached_prefix(b)
    assert [blk.block_id for blk in hits] == [1, 2]
    assert kv.free_after(hits) == 7  # held hits leave the free queue untouched
    assert kv.admit(b, hits, 8)
    assert b.block_table == [1, 2, 4]
    assert b.num_registered_blocks == 2
    assert [pool.blocks[i].ref_count for i in (1, 2, 3, 4)] == [2, 2, 1, 1]


def test_the_last_token_is_never_taken_from_the_cache():
    _, kv = make()
    a = seq(list(range(32)), "a")
    run_prompt(kv, a)
    # 32 tokens = 2 full blocks, but only the first may be a hit: token 31 gives the logits
    assert KVCacheManager.max_cached_blocks(a, BS) == 1
    assert [blk.block_id for blk in kv.cached_prefix(seq(list(range(32)), "b"))] == [1]


def test_free_releases_tail_first_and_keeps_cached_blocks_evictable():
    pool, kv = make()
    s = seq(list(range(40)))
    run_prompt(kv, s)
    kv.free(s)
    assert s.block_table == [] and s.num_registered_blocks == 0
    # 3 (private) goes to the front; 2 then 1 (cached) to the back: tail evicted before head
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert pool.num_cached == 2
    # a hit on a freed cached block takes it out of the free queue again
    b = seq(list(range(17)), "b")
    hits = kv.cached_prefix(b)
    assert [blk.block_id for blk in hits] == [1]
    assert kv.free_after(hits) == 9
    assert kv.admit(b, hits, 1)
    assert b.block_table == [1, 3]
    assert pool.blocks[1].ref_count == 1


def test_reserve_grows_only_when_a_block_fills_and_fails_without_taking():
    pool, kv = make()
    s = seq(list(range(16)))
    kv.admit(s, [], 16)
    s.num_computed_tokens = 16
    assert kv.reserve(s, 0) and s.block_table == [1]
    assert kv.reserve(s, 1) and s.block_table == [1, 2]
    assert kv.reserve(s, 15) and s.block_table == [1, 2]  # still inside block 2
    assert kv.room(s) == 16 + 8 * BS
    assert not kv.reserve(s, 16 + 9 * BS)  # more than the pool holds: nothing taken
    assert s.block_table == [1, 2] and pool.num_free == 8


def test_admit_fails_without_taking_when_the_pool_is_short():
    pool, kv = make()
    big = seq(list(range(11 * BS)))
    assert not kv.admit(big, [], big.num_tokens)
    assert big.block_table == [] and pool.num_free == 10
