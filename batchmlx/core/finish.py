"""Finish rules, in one place: when a sequence is done, and where its text ends.

- Context length: the fit is checked once, where a request's 400 is answered (`fits_context`,
  in worker/translate: `context_length_exceeded` when the prompt, or the prompt plus the
  `max_tokens` the request sets, does not fit). An engine does not check it again. Its `add`
  (`FinishRules.for_request`) only bounds generation by what the context leaves
  (`max_new_tokens`: `max_tokens` None means until the context is full, a larger one is cut to
  the room left), and raises ValueError for an empty prompt or one that leaves no room at all:
  that is a caller's bug, and tests and benchmarks calling `Engine.add` directly get the same.
- Per sampled token (`FinishRules.on_token`, run by core/postprocess.py for both engines): an
  end-of-sequence token ends with STOP (the token is not output), reaching max tokens ends with
  LENGTH.
- Structured outputs (`grammar_finish`): a constrained answer whose JSON value is complete with
  the token just output ends with STOP, ahead of LENGTH.
- Stop strings are matched on decoded text: the engine stops generating when one appears in the
  decoded tail (`FinishRules.stop_in_tail`), and every text the user sees is cut before the
  first one with `cut_at_stop` (whole answers) or `visible` (streams, which also hold back a
  tail that could still grow into a stop string).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from batchmlx.core.request import FinishReason, GenerationRequest

STOP_TAIL_EXTRA_TOKENS = 8  # decoded tail = longest stop string in characters + this many tokens


def fits_context(prompt_tokens: int, context_tokens: int, max_tokens: int | None = None) -> bool:
    """Whether a prompt leaves room for the tokens asked for: `max_tokens` of them when the
    request sets it (OpenAI refuses rather than clamps), else at least one."""
    if max_tokens is None:
        return prompt_tokens < context_tokens
    return prompt_tokens + max_tokens <= context_tokens


def max_new_tokens(requested: int | None, prompt_tokens: int, context_tokens: int) -> int:
    """Tokens a request may generate: what it asked for (None: no limit), within the context
    left."""
    room = context_tokens - prompt_tokens
    return room if requested is None else min(requested, room)


@dataclass(frozen=True, slots=True)
class FinishRules:
    """One sequence's token-level finish rules, applied by the engine's postprocess."""

    max_tokens: int  # already bounded by the context (max_new_tokens)
    stop_token_ids: Collection[int]  # end-of-sequence and friends
    stops: tuple[str, ...] = ()  # stop strings

    @classmethod
    def for_request(cls, req: GenerationRequest, context_tokens: int) -> FinishRules:
        """The rules of a request an engine adds (the module docstring says the one rule)."""
        n_prompt = len(req.prompt_tokens)
        if n_prompt == 0:
            raise ValueError("empty prompt")
        budget = max_new_tokens(req.params.max_tokens, n_prompt, context_tokens)
        if budget < 1:  # callers check the context first (a 400): reaching here is a bug
            raise ValueError(
                f"prompt of {n_prompt} tokens leaves no room in a context of "
                f"{context_tokens} tokens"
            )
        return cls(budget, req.stop_token_ids, req.params.stop)

    def is_eos(self, token: int) -> bool:
        return token in self.stop_token_ids

    def on_token(self, token: int, num_generated: int) -> FinishReason | None:
        """After sampling `token`, the num_generated-th generated token (itself included)."""
        if self.is_eos(token):
            return FinishReason.STOP
        if num_generated >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    @property
    def tail_tokens(self) -> int:
        """Generated tokens to decode so that a newly completed stop string lies inside them."""
        return max(len(s) for s in self.stops) + STOP_TAIL_EXTRA_TOKENS

    def stop_in_tail(self, generated: Sequence[int], decode: Callable[[list[int]], str]) -> bool:
        """Whether the text of the last generated tokens holds a stop string. Only the tail can
        newly contain one, since this runs after every token."""
        if not self.stops:
            return False
        tail = decode(list(generated[-self.tail_tokens :]))
        return any(s in tail for s in self.stops)


def grammar_finish(reason: FinishReason | None, complete: bool) -> FinishReason | None:
    """The finish of a grammar-constrained sequence after an output token: STOP once its
    grammar (a JSON value) is complete, else what `FinishRules.on_token` said."""
    return FinishReason.STOP if complete else reason


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest stop string in text[start:], or -1."""
    return min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)


def cut_at_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[str, bool]:
    """Text cut before the first stop string at or after `start`; True if one was found."""
    cut = find_stop(text, stops, start)
    return (text[:cut], True) if cut >= 0 else (text, False)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could still grow into a stop string."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


def visible(text: str, stops: Sequence[str], start: int = 0) -> tuple[str, bool]:
    """What a stream may show of a text still growing: cut at a stop string (True), else
    without the tail that could become one."""
    text, stopped = cut_at_stop(text, stops, start)
    if not stopped:
        text = text[: len(text) - held_back(text, stops)]
    return text, stopped
