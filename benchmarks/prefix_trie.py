"""Block-granular prefix tries over prompts (a benchmark and test oracle): the prefill lower
bound and a grouped admission order.

Sharing is per full block, chained from the first one, as in the block pool: block i of two
prompts can be shared only if blocks 0..i are equal in both. Only the first
`(len(prompt) - 1) // block_size` blocks of a prompt can ever be taken from a cache, because its
last token must be computed to produce the logits of the first generated token.
"""

from __future__ import annotations

from collections.abc import Sequence


def shareable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt a prefix cache can supply (its last token is always computed)."""
    return max(0, (num_tokens - 1) // block_size)


def block_prefix_lower_bound(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """The fewest prefill tokens any engine must compute for `prompts` with block-granular sharing.

    Every prompt computes its own tail itself: the tokens after its shareable blocks,
    `len(p) - shareable(p) * block_size`, since no cache can supply them. Build the trie of the
    prompts' full blocks (node = a block's tokens under its parent node). Every node that is
    shareable for some prompt must be computed once by someone; it costs nothing extra when it
    is a full block inside some prompt's tail (a prompt of exactly k blocks computes its last
    block anyway, and a longer prompt may then hit it), else `block_size` tokens. So:

        bound = sum of tails + block_size * |shareable nodes not inside any tail|

    An engine reaches it when each shared block is computed once, tail-computing prompts run
    before the prompts that reuse their last block, and nothing is evicted before its last
    user is admitted. Generated tokens are ignored (they could, by chance, fill a block some
    prompt shares) and so is recomputation after preemption. Prompts must be non-empty.
    """
    if block_size < 1:
        raise ValueError("block_size must be positive")
    nodes: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent node, block tokens) -> node
    shareable: set[int] = set()  # nodes some prompt can take from a cache
    in_tail: set[int] = set()  # nodes some prompt computes as part of its own tail
    own_tokens = 0
    for prompt in prompts:
        if not prompt:
            raise ValueError("empty prompt")
        k = shareable_blocks(len(prompt), block_size)
        parent = 0  # the root
        for i in range(len(prompt) // block_size):
            key = (parent, tuple(prompt[i * block_size : (i + 1) * block_size]))
            parent = nodes.setdefault(key, len(nodes) + 1)
            (shareable if i < k else in_tail).add(parent)
        own_tokens += len(prompt) - k * block_size
    return len(shareable - in_tail) * block_size + own_tokens


def group_order(prompts: Sequence[Sequence[int]], block_size: int = 16) -> list[int]:
    """An admission order (indices into prompts) that keeps prompts sharing blocks adjacent.

    A depth-first walk of the block trie: siblings in order of their first prompt, and a prompt
    that ends at a node (no deeper shareable block) placed by its own position among them.
    Prompts sharing no full block keep their FIFO order; a shared first token (a BOS) does not
    group anything.
    """
    order: list[int] = []
    stack: list[tuple[list[int], int]] = [(list(range(len(prompts))), 0)]
    while stack:
        indices, depth = stack.pop()
        if len(indices) == 1:
            order.append(indices[0])
            continue
        # Keyed by the next block, or by the index itself for a prompt that ends here.
        children: dict[object, list[int]] = {}
        for i in indices:
            if shareable_blocks(len(prompts[i]), block_size) <= depth:
                children[i] = [i]
            else:
                block = tuple(prompts[i][depth * block_size : (depth + 1) * block_size])
                children.setdefault(block, []).append(i)
        stack.extend((group, depth + 1) for group in reversed(children.values()))
    return order
