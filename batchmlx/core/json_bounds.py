"""How long a JSON number in a constrained answer may be: a regex, and a grammar of all JSON with
numbers so bounded (pure; the engine intersects it with the schema's grammar, engine/grammar.py).

A JSON schema's `number` and `integer` allow digits without end, and a greedy small model can
take that offer ("population_millions": 111232323333333333...) until `max_tokens` cuts the answer
short. The bound is on the text: at most `mantissa_digits` digits before the exponent (the `0` of
`0.5` not counted), at most `exponent_digits` in it, and a magnitude below 10**`max_exponent`,
so that no number reads back as infinity. The defaults keep every int64 and uint64 (20 digits at
most) and every float64 below 1e308 (17 significant digits and exponents down to -324 suffice:
`5e-324`); only [1e308, 1.797e308], float64's last sliver, cannot be written.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NumberBounds:
    mantissa_digits: int = 20  # before the exponent: integer part and fraction together
    exponent_digits: int = 3  # after the e / E and its sign
    max_exponent: int = 308  # |value| < 10**max_exponent (float64's largest is 1.797e308)

    def __post_init__(self) -> None:
        if self.mantissa_digits < 1 or self.exponent_digits < 1:
            raise ValueError("number bounds must allow at least one digit")
        if self.max_exponent < self.mantissa_digits:
            raise ValueError("max_exponent must leave room for mantissa_digits")


NUMBER_BOUNDS = NumberBounds()


def number_regex(bounds: NumberBounds = NUMBER_BOUNDS) -> str:
    """A JSON number (RFC 8259's grammar) within `bounds`; Python `re` and llguidance alike."""
    m, top = bounds.mantissa_digits, bounds.max_exponent
    # `0.ddd`: up to m fraction digits, below 10**e; an integer part of i digits leaves m - i for
    # the fraction (none once i == m) and is below 10**(i + e): one alternative per length
    alts = [rf"0(\.[0-9]{{1,{m}}})?{_exponent(top, bounds)}"]
    for i in range(1, m + 1):
        head = "[1-9]" if i == 1 else f"[1-9][0-9]{{{i - 1}}}"
        fraction = "" if i == m else rf"(\.[0-9]{{1,{m - i}}})?"
        alts.append(head + fraction + _exponent(top - i, bounds))
    return f"-?({'|'.join(alts)})"


def _exponent(most: int, bounds: NumberBounds) -> str:
    """An optional exponent: negative ones of up to `exponent_digits` digits (they only
    underflow towards 0), positive ones up to `most`."""
    width = bounds.exponent_digits
    return rf"([eE](-[0-9]{{1,{width}}}|\+?{_at_most(most, width)}))?"


def _at_most(n: int, width: int) -> str:
    """1 to `width` digits (leading zeros allowed, as JSON's exponents allow them) worth <= n."""
    alts = []
    for w in range(1, width + 1):
        if n >= 10**w - 1:
            alts.append(f"[0-9]{{{w}}}")
        else:  # n has at most w digits: compare digit by digit, zero-padded
            alts.append(_lexically_at_most(str(n).zfill(w)))
    return f"({'|'.join(alts)})"


def _lexically_at_most(digits: str) -> str:
    """Strings of len(digits) digits that sort at or below `digits`."""
    first, rest = digits[0], digits[1:]
    same = first + (_lexically_at_most(rest) if rest else "")
    if first == "0":
        return same
    below = f"[0-{int(first) - 1}]" + (f"[0-9]{{{len(rest)}}}" if rest else "")
    return f"({below}|{same})"


# Any JSON value, spaced in any way, its strings as JSON allows them: a superset of every text a
# schema's grammar admits, save numbers longer than the bound.
_JSON_LARK = r"""start: value
value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" (pair ("," pair)*)? "}"
pair: STRING ":" value
array: "[" (value ("," value)*)? "]"
STRING: /"(\\(["\\\/bfnrt]|u[0-9a-fA-F]{4})|[^"\\\x00-\x1F])*"/
NUMBER: /@NUMBER@/
%ignore /[ \t\n\r]+/
"""


def bounded_json_lark(bounds: NumberBounds = NUMBER_BOUNDS) -> str:
    """A Lark grammar (llguidance's dialect) of any JSON value whose numbers keep `bounds`."""
    return _JSON_LARK.replace("@NUMBER@", number_regex(bounds))
