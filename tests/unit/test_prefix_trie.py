from __future__ import annotations

import pytest

from benchmarks.prefix_trie import block_prefix_lower_bound, group_order, shareable_blocks

BS = 16


def test_shareable_blocks_keeps_the_last_token_to_compute():
    assert shareable_blocks(1, BS) == 0
    assert shareable_blocks(16, BS) == 0
    assert shareable_blocks(17, BS) == 1
    assert shareable_blocks(32, BS) == 1
    assert shareable_blocks(40, BS) == 2


def test_lower_bound_of_identical_prompts():
    p = list(range(40))
    # 2 shareable blocks computed once, then 8 own tokens per prompt.
    assert block_prefix_lower_bound([p, p], BS) == 2 * 16 + 8 + 8
    q = list(range(32))
    # Only block 0 can be shared: block 1 holds the last token.
    assert block_prefix_lower_bound([q, q, q], BS) == 16 + 3 * 16


def test_lower_bound_of_unrelated_and_partly_shared_prompts():
    a = list(range(40))
    b = list(range(1000, 1040))
    assert block_prefix_lower_bound([a, b], BS) == 80
    c = a[:16] + list(range(500, 524))  # shares block 0 with a
    assert block_prefix_lower_bound([a, c], BS) == 3 * 16 + 8 + 8
    # Equal second blocks under different first blocks are different nodes.
    d = list(range(2000, 2016)) + a[16:40]
    assert block_prefix_lower_bound([a, d], BS) == 4 * 16 + 8 + 8


def test_lower_bound_counts_a_block_computed_in_a_tail_once():
    p = list(range(32))  # its block 1 holds its last token: computed by p itself
    q = p + list(range(100, 108))  # can hit both of p's blocks
    # Tails 16 (p) + 8 (q); block 0 costs 16; block 1 is already paid for by p's tail.
    assert block_prefix_lower_bound([p, q], BS) == 16 + 8 + 16


def test_lower_bound_rejects_empty_prompts():
    with pytest.raises(ValueError):
        block_prefix_lower_bound([[]], BS)


def test_group_order_puts_prompts_sharing_blocks_together_and_keeps_fifo_otherwise():
    sys_a = list(range(100, 132))
    sys_b = list(range(200, 232))
    prompts = [
        sys_a + [1, 2],  # 0
        sys_b + [3],  # 1
        sys_a + [4],  # 2
        [0] + list(range(300, 330)),  # 3: shares only a first token with 4
        sys_b + [5, 6],  # 4
        [0] + list(range(400, 430)),  # 5
        [7, 8],  # 6: too short to share
    ]
    assert group_order(prompts, BS) == [0, 2, 1, 4, 3, 5, 6]


def test_group_order_groups_by_the_deepest_shared_block():
    base = list(range(16))
    x = list(range(50, 66))
    y = list(range(70, 86))
    prompts = [base + x + [1], base + y + [1], base + x + [2], [9] * 20]
    assert group_order(prompts, BS) == [0, 2, 1, 3]
    assert group_order([], BS) == []
