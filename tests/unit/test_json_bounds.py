"""The number bound of constrained answers (pure): which JSON numbers the regex admits. Before:
there was no bound (core/json_bounds.py did not exist) and a `number` could run on for ever."""

from __future__ import annotations

import json
import random
import re
import struct

import pytest

from batchmlx.core.json_bounds import (
    NUMBER_BOUNDS,
    NumberBounds,
    bounded_json_lark,
    number_regex,
)

NUMBER = re.compile(number_regex())
RFC_8259 = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def admitted(text: str) -> bool:
    return NUMBER.fullmatch(text) is not None


@pytest.mark.parametrize(
    "text",
    [
        "0", "-0", "7", "-12", "0.5", "-0.25", "3.1415926535897932384",  # 20 digits in all
        "9223372036854775807", "-9223372036854775808", "18446744073709551615",  # int64, uint64
        "9.999999999999999e307", "-8.98846567431158e307", "5e-324", "2.2250738585072014E-308",
        "1e+16", "6.02e23",
        "0.00000000000000000001", "12345678901234567890", "1234567890.1234567890", "1e001",
        "22222222222222222222e288", "0.5e308", "1e-999",  # 1e-999 underflows to 0: harmless
    ],
)  # fmt: skip
def test_every_value_a_float64_or_64_bit_integer_holds_is_admitted(text):
    assert admitted(text), text
    json.loads(text)


@pytest.mark.parametrize(
    "text",
    [
        # 21 digits: past uint64, and past what a float64 holds digit by digit
        "3.14159265358979323846", "1" * 21,
        "-" + "9" * 21, "0." + "0" * 20 + "1", "1234567890.12345678901", "1" * 20 + ".5",
        "1e1000", "1.5E-0001",  # 4 exponent digits: past float64's 308
        # 1e308 and up: float64 holds up to 1.797e308, beyond reads back as infinity
        "1e308", "1.7976931348623157e308", "12e307", "22222222222222222222e322", "1e+0308",
        # not JSON at all: the bound admits only JSON numbers
        "01", "1.", ".5", "+1", "1e", "-", "0x10", "NaN", "Infinity", "1_000",
    ],
)  # fmt: skip
def test_longer_numbers_and_non_json_are_refused(text):
    assert not admitted(text), text


def test_shortest_repr_of_random_float64s_is_admitted():
    """Python's repr is the shortest text that reads back as the same float64: every one of
    them below 1e308 fits the bound (so the bound loses no such value), and is JSON."""
    rng = random.Random(0)
    for _ in range(20_000):
        x = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        if x != x or abs(x) >= 1e308:  # NaN, infinities, and the sliver past 1e308
            continue
        text = repr(x)
        assert admitted(text), text
        assert float(json.loads(text)) == x


def test_the_bound_is_a_subset_of_finite_json_numbers():
    rng = random.Random(1)
    alphabet = "0123456789.-+eE"
    for _ in range(50_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
        if admitted(text):
            assert RFC_8259.fullmatch(text), text
            assert abs(float(text)) < 1e308, text


def test_other_bounds_and_the_grammar_text():
    small = re.compile(number_regex(NumberBounds(3, exponent_digits=2, max_exponent=12)))
    assert small.fullmatch("123") and small.fullmatch("1.23") and small.fullmatch("0.123e5")
    assert small.fullmatch("12e10") and small.fullmatch("1e-99") and small.fullmatch("0.1e12")
    assert not small.fullmatch("1234") and not small.fullmatch("12.34")
    assert not small.fullmatch("12e11") and not small.fullmatch("1e100")
    # every exponent the alphabet can spell: admitted exactly when the value is below 1e12
    for digits in ("1", "12", "123", "0.5"):
        for e in range(100):
            for text in (f"{digits}e{e}", f"{digits}e{e:02d}"):
                assert bool(small.fullmatch(text)) == (float(text) < 1e12), text
    lark = bounded_json_lark()
    assert f"NUMBER: /{number_regex(NUMBER_BOUNDS)}/" in lark
    with pytest.raises(ValueError):
        NumberBounds(mantissa_digits=0)
    with pytest.raises(ValueError):
        NumberBounds(mantissa_digits=20, max_exponent=10)
