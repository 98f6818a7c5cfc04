"""The block pool: metadata of the paged KV cache, with ref counts and a prefix cache.

A block holds the KV of `block_size` consecutive tokens of one or more sequences. This module
knows only ids, ref counts and hashes; the MLX layer stores the actual KV at the same block ids.

Prefix cache: a block that is full and computed is registered under a chained hash (its parent's
hash folded into its own), so a block hash names a whole prefix. A block whose ref count drops to
0 stays in the hash map while it sits in the free queue; it is only forgotten when allocate()
takes it for reuse (eviction). The free queue is the LRU order of eviction.

Never-used blocks are kept apart from the free queue: the MLX storage grows to the highest block
id handed out, so allocate() reuses blocks the storage already backs (free ones, never-used ones
below `backed_blocks`, then the least recently used cached ones) before it hands out a block that
makes the storage grow.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

NULL_BLOCK_ID = 0  # reserved scratch block: never handed out, the MLX layer writes padding there

HashFn = Callable[[int | None, Seq[int]], int]


def hash_block(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """Chained hash of one full block: 128-bit blake2b over the parent's hash and the token ids.

    blake2b rather than `hash()`: it is the same in every process and on every machine, so a
    hash can be logged, compared across runs or persisted. 128 bits make an accidental
    collision between two different prefixes practically impossible; a collision on the block
    itself is caught anyway because lookup() compares the stored token ids.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(16, "little"))
    tokens = array("q", token_ids)
    if sys.byteorder == "big":  # same bytes on every platform
        tokens.byteswap()
    h.update(tokens.tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(slots=True, eq=False)
class Block:
    """Metadata of one KV block. Identity equality: two blocks are never interchangeable."""

    block_id: int  # index into the KV storage
    ref_count: int = 0  # block tables holding it; 0 means it sits in the free queue
    block_hash: int | None = None  # chained hash, set only while the block is full and cached
    token_ids: tuple[int, ...] = ()  # the full block's tokens, checked behind every hash hit

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


class BlockPool:
    """Blocks 1..num_blocks-1, a free queue in eviction order, and the prefix-cache hash map.

    "Cannot allocate" is a return value (None); misuse (double free, touching block 0) raises.
    """

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = hash_block) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is reserved)")
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_fn = hash_fn  # injected so tests can force collisions
        # Block i exists once handed out (ids below _fresh): a pool bounded by memory may count
        # hundreds of thousands of blocks for a small model, and most are never used.
        self.blocks = [Block(NULL_BLOCK_ID)]
        # Blocks used before and now unreferenced: uncached at the front (reused first), cached
        # at the back in LRU order. OrderedDict: O(1) pop-front, push-front/back and removal.
        self._free: OrderedDict[int, Block] = OrderedDict()
        self._fresh = 1  # blocks _fresh..num_blocks-1 were never handed out
        # Block ids below this are backed by storage (the MLX layer sets it as its arrays grow);
        # a never-used block past it is handed out only when no backed block is left.
        self.backed_blocks = num_blocks
        self._cached: dict[int, Block] = {}  # block hash -> the block holding that prefix
        self.queries = 0  # lookup() calls
        self.hits = 0  # lookup() calls that returned a block
        self.evictions = 0  # cached blocks forgotten because allocate() reused them

    # -- counters ---------------------------------------------------------------------------

    @property
    def null_block(self) -> Block:
        return self.blocks[NULL_BLOCK_ID]

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out, cached-but-unreferenced ones included."""
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_ever_used(self) -> int:
        """Blocks handed out at least once (block 0 excluded): what the storage must back."""
        return self._fresh - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by some sequence."""
        return self.num_used / self.num_usable

    def free_block_ids(self) -> list[int]:
        """Every free block in the order allocate() hands them out."""
        uncached = [i for i, b in self._free.items() if b.block_hash is None]
        cached = [i for i, b in self._free.items() if b.block_hash is not None]
        split = max(self._fresh, min(self.backed_blocks, self.num_blocks))
        backed, unbacked = range(self._fresh, split), range(split, self.num_blocks)
        return [*uncached, *backed, *cached, *unbacked]

    # -- allocation -------------------------------------------------------------------------

    def allocate(self) -> Block | None:
        """A free block with ref count 1, or None if none is free. Order: a freed uncached block,
        a never-used block the storage backs, the least recently used cached block (evicted),
        then a never-used block past the storage (the storage grows)."""
        front = next(iter(self._free.values()), None)
        if front is not None and front.block_hash is None:
            block = self._free.popitem(last=False)[1]
        elif self._fresh < min(self.backed_blocks, self.num_blocks) or (
            front is None and self._fresh < self.num_blocks
        ):
            block = Block(self._fresh)
            self.blocks.append(block)
            self._fresh += 1
        elif front is not None:
            block = self._free.popitem(last=False)[1]
            self._evict(block)
        else:
            return None
        block.ref_count = 1
        return block

    def allocate_many(self, n: int) -> list[Block] | None:
        """n blocks, or None (and nothing taken) if fewer than n are free."""
        if n > self.num_free:
            return None
        return [self.allocate() for _ in range(n)]  # type: ignore[misc]

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference to each block, in the given order.

        A block reaching 0 goes to the back of the queue if it holds a cached prefix (so prefix
        hits live longer) and to the front otherwise (reused first). Pass a sequence's blocks in
        reverse order so its tail is evicted before its head.
        """
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID or block.ref_count <= 0:
                raise ValueError(f"free of block {block.block_id} that is not held")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def touch(self, block: Block) -> None:
        """One more reference to a block (a prefix-cache hit); leaves the free queue at 0."""
        if block.block_id == NULL_BLOCK_ID:
            raise ValueError("block 0 is reserved")
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    # -- prefix cache -----------------------------------------------------------------------

    def lookup(self, block_hash: int, token_ids: Seq[int]) -> Block | None:
        """The cached block for this hash, only if it holds exactly these tokens."""
        self.queries += 1
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None  # a collision can never hand out another prefix's KV
        self.hits += 1
        return block

    def cache_block(self, block: Block, block_hash: int, token_ids: Seq[int]) -> bool:
        """Register a just-filled, computed block; False if another block already holds the hash."""
        tokens = tuple(token_ids)
        if len(tokens) != self.block_size:
            raise ValueError("only full blocks are cached")
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_id} is not held")
        if block.block_hash is not None:
            if block.block_hash == block_hash and block.token_ids == tokens:
                return True
            raise ValueError(f"block {block.block_id} is already cached under another hash")
        if block_hash in self._cached:
            return False  # keep the existing mapping; this copy stays private and is reused first
        block.block_hash = block_hash
        block.token_ids = tokens
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use stay held); returns how many were dropped."""
        dropped = len(self._cached)
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = ()
            if block.block_id in self._free:  # now a plain free block: reused first
                self._free.move_to_end(block.block_id, last=False)
        self._cached.clear()
        return dropped

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        self.evictions += 1
