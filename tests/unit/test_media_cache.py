"""The prefix cache of image prompts on the real block pool and KV manager (core/media.py): the
same image and prompt hit, the same tokens with another image do not, the same image with
another question shares the image's blocks."""

from __future__ import annotations

from batchmlx.core.blocks import BlockPool
from batchmlx.core.kv_manager import KVCacheManager
from batchmlx.core.media import MediaSpan, media_block_hash
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.core.sequence import Sequence

BS = 4
IMG = 99  # the placeholder token
# 2 system tokens, 6 image placeholders (positions 2..7), then the question
PREFIX = [1, 2] + [IMG] * 6
SPAN = (2, 6)


def seq(question: list[int], digest: bytes, n: int = 0) -> Sequence:
    span = MediaSpan(*SPAN, digest)
    req = GenerationRequest(f"r{n}", PREFIX + question, SamplingParams(), media_spans=(span,))
    return Sequence(req, n)


def run(kv: KVCacheManager, s: Sequence) -> list[int]:
    """Admit s with its hits, compute its prompt, register and free it; the hit block ids."""
    hits = kv.cached_prefix(s)
    assert kv.admit(s, hits, s.num_tokens - len(hits) * BS)
    s.num_computed_tokens = s.num_tokens
    kv.register_full_blocks(s)
    kv.free(s)
    return [b.block_id for b in hits]


def test_same_image_same_prompt_hits_every_block_but_the_last_token():
    kv = KVCacheManager(BlockPool(16, BS), enable_prefix_cache=True)
    q = [5, 6, 7, 8, 9]  # 13 tokens: 3 full blocks
    assert run(kv, seq(q, b"A" * 16)) == []
    assert run(kv, seq(q, b"A" * 16, 1)) == [1, 2, 3]


def test_same_prompt_other_image_reuses_nothing_from_the_image_on():
    kv = KVCacheManager(BlockPool(16, BS), enable_prefix_cache=True)
    q = [5, 6, 7, 8, 9]
    run(kv, seq(q, b"A" * 16))
    # the tokens are identical, but every block touches the image or follows it
    assert run(kv, seq(q, b"B" * 16, 1)) == []


def test_same_image_other_question_reuses_the_image_blocks():
    kv = KVCacheManager(BlockPool(16, BS), enable_prefix_cache=True)
    run(kv, seq([5, 6, 7, 8, 9], b"A" * 16))
    # blocks 0 and 1 hold the system tokens and the image; the question differs after them
    assert run(kv, seq([10, 11, 12, 13, 14], b"A" * 16, 1)) == [1, 2]


def test_a_block_no_span_touches_keeps_the_token_hash_and_hashing_is_memoized():
    spans = (MediaSpan(4, 4, b"A" * 16),)
    assert media_block_hash(123, spans, 0, BS) == 123  # positions 0..3: before the image
    assert media_block_hash(123, spans, 1, BS) != 123
    assert media_block_hash(123, spans, 2, BS) == 123  # after it (the chain carries it on)
    kv = KVCacheManager(BlockPool(16, BS), enable_prefix_cache=True)
    s = seq([5, 6, 7, 8, 9], b"A" * 16)
    first = kv.hashes(s, 3)
    assert kv.hashes(s, 3) is first and len(first) == 3  # memoized on the sequence
    plain = Sequence(GenerationRequest("t", PREFIX + [5, 6, 7, 8, 9], SamplingParams()), 9)
    # the same tokens without the image's key: every block differs (block 0 holds image tokens)
    assert all(a != b for a, b in zip(kv.hashes(plain, 3), first, strict=True))
