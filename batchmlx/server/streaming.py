"""Streamed text that agrees with the non-streamed answer.

Each choice decodes its cumulative tokens and sends only the new suffix. Text is held back while
it ends in an incomplete UTF-8 character ("\\ufffd") or could be the start of a stop string, and
the last delta is taken from the finished body, so the chunks always join into its text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what decoding gives for the first bytes of an unfinished character


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could still grow into a stop string."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


class ChoiceStream:
    """One choice's text as tokens arrive; `flush` returns what may be sent now."""

    def __init__(
        self, decode: Callable[[list[int]], str], stops: Sequence[str], prefix: str = ""
    ) -> None:
        self.decode = decode
        self.stops = tuple(stops)
        self.prefix = prefix  # completions with echo: the prompt comes first
        self.tokens: list[int] = []
        self.unsent = 0  # tokens added since the last flush
        self.sent = ""
        self.stopped = False  # a stop string appeared: nothing more is sent before the end

    def add(self, token_id: int) -> None:
        self.tokens.append(token_id)
        self.unsent += 1

    def flush(self) -> str:
        self.unsent = 0
        if self.stopped:
            return ""
        text = self.prefix + self.decode(self.tokens)
        cuts = [i for i in (text.find(s, len(self.prefix)) for s in self.stops) if i >= 0]
        if cuts:
            text, self.stopped = text[: min(cuts)], True
        else:
            text = text[: len(text) - held_back(text, self.stops)]
        text = text.rstrip(REPLACEMENT)
        if not text.startswith(self.sent):
            return ""  # decoding revised earlier text: wait for the final body
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the finished body's text."""
        delta = final_text[len(self.sent) :] if final_text.startswith(self.sent) else ""
        self.sent = final_text
        return delta
