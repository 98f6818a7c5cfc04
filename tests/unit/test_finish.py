"""Finish rules alone: context, end of sequence, max tokens, stop strings on text."""

from __future__ import annotations

from batchmlx.core.finish import (
    FinishRules,
    cut_at_stop,
    find_stop,
    fits_context,
    held_back,
    max_new_tokens,
    visible,
)
from batchmlx.core.request import FinishReason

VOCAB = {1: "Hel", 2: "lo", 3: " wo", 4: "rld", 5: ".", 6: " E", 7: "ND"}


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def test_context_leaves_room_for_one_token_at_least():
    assert fits_context(99, 100)
    assert not fits_context(100, 100)
    assert fits_context(90, 100, max_tokens=10)  # what the request sets must fit whole
    assert not fits_context(90, 100, max_tokens=11)
    assert max_new_tokens(16, 90, 100) == 10  # the context bounds what was asked
    assert max_new_tokens(16, 10, 100) == 16
    assert max_new_tokens(None, 10, 100) == 90  # None: until the context is full


def test_end_of_sequence_stops_before_max_tokens_ends_with_length():
    rules = FinishRules(max_tokens=3, stop_token_ids=frozenset({0}))
    assert rules.on_token(0, 1) is FinishReason.STOP
    assert rules.on_token(0, 3) is FinishReason.STOP  # eos wins on the last token too
    assert rules.on_token(1, 2) is None
    assert rules.on_token(1, 3) is FinishReason.LENGTH


def test_stop_string_is_found_in_the_decoded_tail():
    rules = FinishRules(max_tokens=99, stop_token_ids=frozenset(), stops=(" END",))
    assert rules.tail_tokens == 4 + 8
    assert not rules.stop_in_tail([1, 2, 3, 6], decode)
    assert rules.stop_in_tail([1, 2, 3, 6, 7], decode)  # across two tokens
    assert not FinishRules(99, frozenset()).stop_in_tail([6, 7], decode)  # no stop strings


def test_the_tail_is_the_last_tokens_only():
    rules = FinishRules(max_tokens=99, stop_token_ids=frozenset(), stops=("x",))
    assert rules.tail_tokens == 9
    seen: list[list[int]] = []
    rules.stop_in_tail(list(range(20)), lambda ids: seen.append(ids) or "")
    assert seen == [list(range(11, 20))]


def test_cut_at_the_earliest_stop_string():
    assert find_stop("Hello world.", ["o", "."]) == 4
    assert cut_at_stop("Hello world.", ["world", "lo"]) == ("Hel", True)
    assert cut_at_stop("Hello world.", ["!"]) == ("Hello world.", False)
    assert cut_at_stop("Say: lo and lo", ["lo"], start=5) == ("Say: ", True)  # after the echo


def test_held_back_is_the_longest_stop_prefix_at_the_end():
    assert held_back("abc E", [" END"]) == 2
    assert held_back("abc EN", [" END", "N"]) == 3
    assert held_back("abc", [" END"]) == 0
    assert held_back("abc END", [" END"]) == 0  # a whole stop string is cut, not held


def test_visible_text_cuts_or_holds_back():
    assert visible("Hello E", [" END"]) == ("Hello", False)
    assert visible("Hello END more", [" END"]) == ("Hello", True)
    assert visible("Hello", [" END"]) == ("Hello", False)
