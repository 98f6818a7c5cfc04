"""Streamed text that agrees with the non-streamed answer.

Each choice decodes its cumulative tokens and sends only the new suffix. Text is held back while
it ends in an incomplete UTF-8 character ("\\ufffd") or could be the start of a stop string (the
stop rules are core/finish's), and the last delta is taken from the finished body, so the
chunks always join into its text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from batchmlx.core.finish import visible

REPLACEMENT = "\ufffd"  # what decoding gives for the first bytes of an unfinished character


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
        text, self.stopped = visible(
            self.prefix + self.decode(self.tokens), self.stops, len(self.prefix)
        )
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
