"""How many batch prompt tokens a step beside online work may carry, by measured time (issue 49,
item 3: a step carrying online work stays within a bound of a decode step).

A fixed token bound is a different time on each machine and load: 256 batch prompt tokens beside
8 online decodes took 230-650 ms on a shared 2-core CPU against 100-180 ms for the decodes alone,
and an online token (or a new request's first) waited for all of it. The scheduler reports each
step beside online work: its prompt tokens (online and batch) and its time. Steps with no prompt
tokens give a decode step's time, steps with some the time a prompt token adds; both are
exponential averages, so the bound follows the machine's load. A step then carries at most
`(ratio - 1) x decode step / token time` batch prompt tokens, within [floor, ceiling]: the
floor keeps the batch moving whatever the measures say, the ceiling is the token bound. While
batch prompts are pending every step carries some, so a step without batch prompts is taken
to measure a decode step first and again every REFRESH steps.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.2  # weight of the newest step in the averages: a few steps follow a change of load
REFRESH = 32  # steps with prompt tokens after which a decode step is measured again


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


@dataclass(slots=True)
class PrefillPace:
    ratio: float  # a step beside online work takes at most about this many decode steps
    ceiling: int  # batch prompt tokens at most (batch_prefill_beside_online)
    floor: int = 16  # and at least, when the ceiling allows
    decode_s: float | None = None  # a step with no prompt tokens (average)
    token_s: float | None = None  # what one prompt token adds to a step (average)
    since_decode: int = 0  # steps with prompt tokens since the last without

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """A step beside online work: its prompt tokens and its time."""
        if prompt_tokens == 0:
            self.decode_s = _average(self.decode_s, seconds)
            self.since_decode = 0
            return
        self.since_decode += 1
        if self.decode_s is not None:
            added = max(seconds - self.decode_s, 0.0) / prompt_tokens
            self.token_s = _average(self.token_s, added)

    def tokens(self) -> int:
        """Batch prompt tokens the next step beside online work may carry."""
        if self.ratio <= 0:
            return self.ceiling  # off: the token bound alone
        if self.decode_s is None or self.since_decode >= REFRESH:
            return 0  # a step without batch prompts measures a decode step
        if not self.token_s:
            return self.ceiling  # measures what a prompt token adds
        fit = round((self.ratio - 1.0) * self.decode_s / self.token_s)
        return min(self.ceiling, max(self.floor, fit))
