"""The block pool alone: exact block ids, ref counts and free-queue order (11 x 16 tokens)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from batchmlx.core.blocks import NULL_BLOCK_ID, BlockPool, hash_block

BS = 16


def tokens(start: int, n: int = BS) -> list[int]:
    return list(range(start, start + n))


def make_pool(**kwargs) -> BlockPool:
    return BlockPool(num_blocks=11, block_size=BS, **kwargs)


def cache_chain(pool: BlockPool, blocks, token_blocks) -> list[int]:
    """Register blocks as a chained prefix; returns their hashes."""
    hashes, parent = [], None
    for block, toks in zip(blocks, token_blocks, strict=True):
        parent = hash_block(parent, toks)
        assert pool.cache_block(block, parent, toks)
        hashes.append(parent)
    return hashes


def test_initial_state_reserves_block_zero():
    pool = make_pool()
    assert pool.num_free == 10
    assert pool.num_used == 0
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert pool.null_block.block_id == NULL_BLOCK_ID
    assert pool.usage == 0.0


def test_allocate_hands_out_ids_in_order_until_exhausted():
    pool = make_pool()
    blocks = [pool.allocate() for _ in range(10)]
    assert [b.block_id for b in blocks] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert [b.ref_count for b in blocks] == [1] * 10
    assert pool.allocate() is None  # a return value, not an exception
    assert pool.num_free == 0
    assert pool.usage == 1.0


def test_allocate_many_is_all_or_nothing():
    pool = make_pool()
    assert [b.block_id for b in pool.allocate_many(7)] == [1, 2, 3, 4, 5, 6, 7]
    assert pool.allocate_many(4) is None
    assert pool.free_block_ids() == [8, 9, 10]


def test_free_puts_cached_blocks_at_back_and_uncached_at_front_in_reverse_order():
    pool = make_pool()
    seq_blocks = pool.allocate_many(4)  # ids 1..4: two full cached blocks, two private ones
    cache_chain(pool, seq_blocks[:2], [tokens(0), tokens(16)])
    pool.free(reversed(seq_blocks))
    # 4 then 3 pushed to the front; 2 then 1 appended at the back (tail evicted before head).
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert [b.ref_count for b in seq_blocks] == [0, 0, 0, 0]
    assert pool.num_cached == 2


def test_two_sequences_sharing_a_prefix_share_ref_counted_blocks():
    pool = make_pool()
    a = pool.allocate_many(3)  # 1, 2 full and cached; 3 holds the tail
    h1, h2 = cache_chain(pool, a[:2], [tokens(0), tokens(16)])
    hit1 = pool.lookup(h1, tokens(0))
    hit2 = pool.lookup(h2, tokens(16))
    assert (hit1.block_id, hit2.block_id) == (1, 2)
    pool.touch(hit1)
    pool.touch(hit2)
    b_tail = pool.allocate()
    assert b_tail.block_id == 4
    assert [pool.blocks[i].ref_count for i in range(1, 5)] == [2, 2, 1, 1]
    assert pool.hits == 2

    pool.free(reversed(a))  # A finishes: shared blocks still held by B
    assert [pool.blocks[i].ref_count for i in range(1, 5)] == [1, 1, 0, 1]
    assert pool.free_block_ids() == [3, 5, 6, 7, 8, 9, 10]

    pool.free(reversed([hit1, hit2, b_tail]))
    assert pool.free_block_ids() == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1]
    assert pool.num_used == 0


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = make_pool()
    (block,) = pool.allocate_many(1)
    (h,) = cache_chain(pool, [block], [tokens(0)])
    pool.free([block])
    assert pool.free_block_ids()[-1] == 1
    hit = pool.lookup(h, tokens(0))
    pool.touch(hit)
    assert hit.ref_count == 1
    assert 1 not in pool.free_block_ids()
    assert pool.num_free == 9


def test_allocation_evicts_the_least_recently_freed_cached_block_and_its_hash():
    pool = make_pool()
    first = pool.allocate_many(2)  # 1, 2
    h_first = cache_chain(pool, first, [tokens(0), tokens(16)])
    second = pool.allocate_many(1)  # 3
    (h_second,) = cache_chain(pool, second, [tokens(100)])
    pool.free(reversed(first))  # queue: 4..10, 2, 1
    pool.free(second)  # queue: 4..10, 2, 1, 3
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 10, 2, 1, 3]

    taken = pool.allocate_many(8)  # 4..10, then 2: the first cached block to go
    assert [b.block_id for b in taken] == [4, 5, 6, 7, 8, 9, 10, 2]
    assert taken[-1].block_hash is None and taken[-1].token_ids == ()
    assert pool.evictions == 1
    assert pool.num_cached == 2
    assert pool.lookup(h_first[1], tokens(16)) is None  # block 2's prefix is gone
    assert pool.lookup(h_first[0], tokens(0)).block_id == 1
    assert pool.lookup(h_second, tokens(100)).block_id == 3
    assert pool.free_block_ids() == [1, 3]


def test_hash_collision_never_returns_another_blocks_tokens():
    pool = make_pool(hash_fn=lambda parent, toks: 7)  # every block collides
    a, b = pool.allocate_many(2)
    assert pool.cache_block(a, pool.hash_fn(None, tokens(0)), tokens(0))
    assert pool.lookup(7, tokens(50)) is None  # same hash, other tokens: a miss
    assert pool.lookup(7, tokens(0)) is a
    # The hash is taken: b stays uncached, the existing mapping is kept.
    assert pool.cache_block(b, 7, tokens(50)) is False
    assert b.block_hash is None
    pool.free([b, a])
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1]


def test_cache_block_rejects_partial_blocks_and_double_registration():
    pool = make_pool()
    a, b = pool.allocate_many(2)
    with pytest.raises(ValueError):
        pool.cache_block(a, 1, tokens(0, 15))
    assert pool.cache_block(a, 1, tokens(0))
    assert pool.cache_block(a, 1, tokens(0))  # idempotent
    with pytest.raises(ValueError):
        pool.cache_block(a, 2, tokens(0))


def test_double_free_and_block_zero_are_bugs():
    pool = make_pool()
    block = pool.allocate()
    pool.free([block])
    with pytest.raises(ValueError):
        pool.free([block])
    with pytest.raises(ValueError):
        pool.touch(pool.null_block)
    with pytest.raises(ValueError):
        pool.free([pool.null_block])


def test_reset_prefix_cache_forgets_every_hash():
    pool = make_pool()
    blocks = pool.allocate_many(2)
    hashes = cache_chain(pool, blocks, [tokens(0), tokens(16)])
    pool.free(reversed(blocks))
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached == 0
    assert pool.lookup(hashes[0], tokens(0)) is None
    assert all(b.block_hash is None for b in pool.blocks)


def test_hash_block_is_chained_and_stable_across_processes():
    h1 = hash_block(None, tokens(0))
    h2 = hash_block(h1, tokens(16))
    assert h2 != hash_block(None, tokens(16))  # the parent is part of the hash
    assert hash_block(None, tokens(0)) == h1
    assert 0 <= h1 < 2**128
    code = (
        "from batchmlx.core.blocks import hash_block;"
        f"print(hash_block(hash_block(None, {tokens(0)}), {tokens(16)}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert int(out.stdout) == h2


def test_cached_blocks_are_reused_before_the_storage_grows():
    # Old pool: never-used blocks sat ahead of evictable cached ones, so a pool that never held
    # more than 3 blocks at once handed out ids up to 6 (and the MLX storage grew to back them).
    pool = make_pool()
    pool.backed_blocks = 4  # the storage backs ids 0..3
    first = pool.allocate_many(3)  # 1, 2, 3
    assert [b.block_id for b in first] == [1, 2, 3]
    cache_chain(pool, first, [tokens(0), tokens(16), tokens(32)])
    pool.free(reversed(first))  # all three stay cached, evictable
    assert pool.free_block_ids() == [3, 2, 1, 4, 5, 6, 7, 8, 9, 10]
    again = pool.allocate_many(3)
    assert [b.block_id for b in again] == [3, 2, 1]  # LRU cached, no id past the storage
    assert pool.evictions == 3
    assert pool.num_ever_used == 3
    assert pool.allocate().block_id == 4  # none left below the storage: now it grows


def test_free_uncached_and_backed_never_used_blocks_come_before_evicting_the_cache():
    pool = make_pool()
    pool.backed_blocks = 6  # ids 1..5 backed
    a, b = pool.allocate_many(2)  # 1, 2
    (h,) = cache_chain(pool, [a], [tokens(0)])
    pool.free([b, a])  # 2 uncached (front), 1 cached (back)
    taken = [pool.allocate().block_id for _ in range(4)]
    assert taken == [2, 3, 4, 5]  # the free one, then backed never-used ones: the cache survives
    assert pool.lookup(h, tokens(0)) is a
    assert pool.allocate().block_id == 1  # now the cached block is evicted, before growing
    assert pool.lookup(h, tokens(0)) is None
    assert pool.allocate().block_id == 6


def test_reset_prefix_cache_moves_its_free_blocks_ahead_of_never_used_ones():
    pool = make_pool()
    pool.backed_blocks = 3
    a, b = pool.allocate_many(2)
    cache_chain(pool, [a, b], [tokens(0), tokens(16)])
    pool.free([b, a])
    assert pool.reset_prefix_cache() == 2
    assert sorted(pool.free_block_ids()[:2]) == [1, 2]
    assert sorted(pool.allocate().block_id for _ in range(2)) == [1, 2]
    assert pool.allocate().block_id == 3
    assert pool.evictions == 0


def test_peak_in_use_bounds_the_ids_handed_out_under_churn():
    """Many short sequences with distinct cached prompts: ids never exceed the peak in use."""
    pool = BlockPool(num_blocks=200, block_size=BS)
    pool.backed_blocks = 1  # the storage grows only as far as the pool asks
    held: list[list] = []
    peak = 0
    for i in range(300):
        blocks = pool.allocate_many(3)
        cache_chain(pool, blocks[:2], [tokens(1000 * i), tokens(1000 * i + 16)])
        held.append(blocks)
        peak = max(peak, pool.num_used)
        if len(held) > 4:
            pool.free(reversed(held.pop(0)))
        pool.backed_blocks = max(pool.backed_blocks, pool.num_ever_used + 1)
    assert peak == 15
    assert pool.num_ever_used == peak
