"""The KV-cache manager: a sequence's blocks, between the scheduler and the block pool.

It owns the block-level bookkeeping of one sequence: the chained hashes of its full blocks,
the prefix-cache lookup at admission, reserving blocks as it grows, registering blocks once
they are full and computed, and releasing them. The scheduler decides who runs; this module
decides which block ids they hold. "Cannot allocate" is a return value (False), as in the pool.
"""

from __future__ import annotations

from batchmlx.core.blocks import Block, BlockPool
from batchmlx.core.media import media_block_hash
from batchmlx.core.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, pool: BlockPool, *, enable_prefix_cache: bool, tile: int = 0) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_cache = enable_prefix_cache
        # Batch invariance (SchedulerConfig.chunk_align): a prompt's rows in its last, partial
        # tile of `tile` positions attend over keys up to the prompt's end, so their KV (and
        # that of the tokens generated after them, decode rows) is not what another prompt
        # computes for the same tokens. Those blocks are hashed with the prompt's length
        # chained in: only the same prompt (a resume, an identical request) hits them. 0: off.
        self.tile = tile

    # -- hashing ----------------------------------------------------------------------------

    def hashes(self, seq: Sequence, n: int) -> list[int]:
        """seq.block_hashes extended to at least n full blocks. A hash depends on the tokens and,
        for a block overlapping an image's placeholder span, on the image's content too
        (core/media.py); memoized on the sequence, so each block is hashed once."""
        bs = self.block_size
        hashes = seq.block_hashes
        spans = seq.request.media_spans
        salted = self._first_salted(seq)
        while len(hashes) < n:
            i = len(hashes)
            h = self.pool.hash_fn(hashes[-1] if hashes else None, seq.block_tokens(i, bs))
            if i == salted:  # token ids are >= 0: no block of tokens hashes to this
                h = self.pool.hash_fn(h, (-1, seq.num_prompt_tokens))
            hashes.append(media_block_hash(h, spans, i, bs) if spans else h)
        return hashes

    def _first_salted(self, seq: Sequence) -> int:
        """The first block reaching past the prompt's last whole tile (see `tile`), or -1."""
        if not self.tile:
            return -1
        return seq.num_prompt_tokens // self.tile * self.tile // self.block_size

    def lookup(self, seq: Sequence, index: int) -> Block | None:
        """The cached block holding seq's block `index` (a full block), or None."""
        block_hash = self.hashes(seq, index + 1)[index]
        return self.pool.lookup(block_hash, seq.block_tokens(index, self.block_size))

    # -- admission --------------------------------------------------------------------------

    @staticmethod
    def max_cached_blocks(seq: Sequence, block_size: int) -> int:
        """Full blocks the cache may supply: the last token is always computed for its logits."""
        return (seq.num_tokens - 1) // block_size

    def cached_prefix(self, seq: Sequence) -> list[Block]:
        """The longest chain of seq's leading full blocks the prefix cache holds (not taken)."""
        max_hit = self.max_cached_blocks(seq, self.block_size)
        if not self.enable_prefix_cache or max_hit == 0:
            return []
        hashes = self.hashes(seq, max_hit)
        hits: list[Block] = []
        for i in range(max_hit):
            block = self.pool.lookup(hashes[i], seq.block_tokens(i, self.block_size))
            if block is None:
                break
            hits.append(block)
        return hits

    def free_after(self, hits: list[Block]) -> int:
        """Blocks left to allocate once the hits are taken (a hit in the free queue leaves it)."""
        return self.pool.num_free - sum(1 for b in hits if b.ref_count == 0)

    def admit(self, seq: Sequence, hits: list[Block], num_new_tokens: int) -> bool:
        """Give seq the hit blocks plus blocks for num_new_tokens after them; False (nothing
        taken) when the pool cannot."""
        need = blocks_for(num_new_tokens, self.block_size)
        if need > self.free_after(hits):
            return False
        for block in hits:
            self.pool.touch(block)
        new = self.pool.allocate_many(need)
        assert new is not None  # checked against the free blocks above
        seq.block_table = [b.block_id for b in hits] + [b.block_id for b in new]
        seq.num_registered_blocks = len(hits)
        return True

    # -- growth -----------------------------------------------------------------------------

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Blocks for num_new_tokens more tokens after seq's computed ones; False (nothing
        taken) when the pool is short."""
        need = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(
            seq.block_table
        )
        if need <= 0:
            return True
        new = self.pool.allocate_many(need)
        if new is None:
            return False
        seq.block_table.extend(b.block_id for b in new)
        return True

    def room(self, seq: Sequence) -> int:
        """Tokens seq could still add: the rest of its blocks plus every free block."""
        held = len(seq.block_table) * self.block_size - seq.num_computed_tokens
        return held + self.pool.num_free * self.block_size

    # -- registration and release -----------------------------------------------------------

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks that became full and computed to the prefix cache."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_registered_blocks:
            return
        hashes = self.hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block = self.pool.blocks[seq.block_table[i]]
            self.pool.cache_block(block, hashes[i], seq.block_tokens(i, bs))
        seq.num_registered_blocks = full

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks; full cached ones stay in the prefix cache, evictable."""
        # Reverse order: the tail of a sequence is evicted before its head.
        self.pool.free(self.pool.blocks[i] for i in reversed(seq.block_table))
        seq.block_table = []
        seq.num_registered_blocks = 0
