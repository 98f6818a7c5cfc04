"""Images and videos in the prefix cache: a prompt's placeholder-token spans and their content.

A vision-language prompt holds a run of placeholder tokens where an image's features go; the
tokens are the same for every image, so a block hash over tokens alone would hand one image's KV
to another. Each full block that overlaps a span has the span's content digest (and where the
span starts) folded into its chained hash, so, as the reference design keys them
(hash(image_content) + hash(prompt)):
- the same image and prompt → the same hashes: a hit;
- the same prompt tokens with another image → other hashes from the first image block on;
- the same image and another question after it → the blocks up to the question are shared.
The digests come from formats.request's content_digest (computed once per request); block hashes
are memoized on the sequence, so nothing here rehashes image bytes per step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """One image's (or video's) placeholder tokens in a prompt."""

    start: int  # position of the first placeholder token
    length: int  # placeholder tokens
    digest: bytes  # the content's key (formats.request.content_digest)

    @property
    def end(self) -> int:
        return self.start + self.length


def media_block_hash(
    block_hash: int, spans: Sequence[MediaSpan], index: int, block_size: int
) -> int:
    """`block_hash` (of block `index`'s tokens, chained) with the content of every span that
    overlaps the block folded in; unchanged for a block no span touches."""
    lo, hi = index * block_size, (index + 1) * block_size
    touching = [s for s in spans if s.start < hi and s.end > lo]
    if not touching:
        return block_hash
    h = hashlib.blake2b(digest_size=16)
    h.update(str(block_hash).encode())
    for span in touching:
        h.update(f"|{span.start}:{span.length}|".encode())
        h.update(span.digest)
    return int.from_bytes(h.digest(), "little")
