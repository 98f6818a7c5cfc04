"""What the engine is asked to do and what it gives back: plain data, no MLX."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from batchmlx.core.media import MediaSpan


class FinishReason(enum.Enum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached, or the context is full


class CacheOutcome(enum.Enum):
    """How much of a prompt the prefix cache already held when the request was admitted."""

    MISS = "MISS"  # nothing reused
    HIT = "HIT"  # the whole prompt (all but the last token, which must be recomputed) reused
    PREFIX_HIT = "PREFIX_HIT"  # part of the prompt reused


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = None  # new tokens at most; None: until the context is full
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None  # same seed, same text, whatever else runs in the batch
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first one
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token, with logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


BATCH_PRIORITY = 1  # queued batch work; more urgent (lower) priorities bypass the adaptive width


@dataclass(slots=True)
class GenerationRequest:
    """One sequence to generate: a prompt already tokenized, and how to sample it."""

    request_id: str  # unique while the engine holds it (the worker uses "<row id>:<choice>")
    prompt_tokens: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()  # eos and friends
    priority: int = BATCH_PRIORITY  # lower is admitted first: online requests 0
    grammar: str | None = None  # a canonical JSON schema text: decoding is constrained to it
    # images and videos: their placeholder spans (keyed into the prefix cache, core/media.py)
    media_spans: tuple[MediaSpan, ...] = ()
    media: Any = None  # the engine's prepared inputs for those spans (pixels), opaque here


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) best first


@dataclass(slots=True)
class GenerationOutput:
    """The finished result of one GenerationRequest."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    cache_outcome: CacheOutcome
    token_ids: list[int]  # generated tokens, stop token excluded
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None
    first_token_s: float | None = None  # seconds from admission to the first token
    extra: dict[str, float] = field(default_factory=dict)
