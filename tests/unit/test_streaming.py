"""Streamed text: held back while it may be a stop string or half a character, and always
joining into the finished body's text."""

from __future__ import annotations

from batchmlx.server.streaming import ChoiceStream

VOCAB = {1: "Hel", 2: "lo", 3: " wo", 4: "rld", 5: "\ufffd", 6: "é", 7: " E", 8: "ND"}


def decode(ids: list[int]) -> str:
    text = "".join(VOCAB[i] for i in ids)
    return text.replace("\ufffdé", "é")  # token 5 + 6: one character split over two tokens


def feed(stream: ChoiceStream, ids: list[int]) -> list[str]:
    out = []
    for i in ids:
        stream.add(i)
        out.append(stream.flush())
    return out


def test_deltas_every_token_join_into_the_text():
    s = ChoiceStream(decode, ())
    assert feed(s, [1, 2, 3, 4]) == ["Hel", "lo", " wo", "rld"]
    assert s.finish("Hello world") == ""


def test_half_a_character_waits_for_the_rest():
    s = ChoiceStream(decode, ())
    assert feed(s, [1, 5, 6]) == ["Hel", "", "é"]


def test_stop_string_is_never_sent():
    s = ChoiceStream(decode, [" END"])
    assert feed(s, [1, 2, 7, 8, 3]) == ["Hel", "lo", "", "", ""]
    assert s.stopped
    assert s.finish("Hello") == ""


def test_a_false_start_of_a_stop_string_is_sent_later():
    s = ChoiceStream(decode, [" EX"])
    assert feed(s, [1, 7, 8]) == ["Hel", "", " END"]


def test_grouped_flush_and_final_text_from_the_body():
    s = ChoiceStream(decode, ())
    for i in (1, 2):
        s.add(i)
    assert s.unsent == 2 and s.flush() == "Hello"
    s.add(3)
    assert s.finish("Hello wo") == " wo"


def test_echo_prefix_comes_first():
    s = ChoiceStream(decode, ["lo"], prefix="Say: ")
    assert feed(s, [1, 2]) == ["Say: He", "l"]  # "l" might have begun "lo"
    assert s.stopped and s.finish("Say: Hel") == ""
