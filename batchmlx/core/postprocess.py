"""One post-processing step per sampled token, whichever engine sampled it.

As vLLM keeps `check_stop` and nano-vllm its `postprocess`, both engines hand each sampled token
to `Postprocessor`, which runs the chain once, in this order:
1. finish rules (core/finish.py): an end-of-sequence token ends with STOP and is not output;
2. the token is output: its log-prob kept (when the request asks for them), the stream
   callback called;
3. the grammar of a constrained request: a completed JSON value ends with STOP, the token output;
4. max tokens reached: LENGTH;
5. a stop string in the decoded tail: STOP.
A finished sequence's `Generation.output` is what the engine gives back.

The grammar is the engine's (llguidance, on MLX's side): core sees it as a callable taking each
output token and saying whether the grammar is complete. The paged engine's feeds the token to
its matcher there; the unpaged engine's matcher is fed by mlx-lm's logits processor, so its
callable only asks whether the matcher has stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from batchmlx.core.engine_api import TokenCallback
from batchmlx.core.finish import FinishRules, grammar_finish
from batchmlx.core.request import (
    CacheOutcome,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    TokenLogprob,
)

GrammarStep = Callable[[int], bool]  # an output token -> whether the grammar is complete now


class Detokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class TokenSink(Protocol):
    """What the step reads of its engine at each token (tests swap the tokenizer)."""

    @property
    def tokenizer(self) -> Detokenizer: ...  # decodes the tail when a request has stop strings

    @property
    def on_token(self) -> TokenCallback | None: ...  # the stream callback, if any


@dataclass(slots=True)
class Generation:
    """What one request has generated so far, as the post-processing step keeps it."""

    request: GenerationRequest
    rules: FinishRules  # FinishRules.for_request: max tokens already bounded by the context
    added_at: float  # engine clock at add(), for the first-token time
    grammar: GrammarStep | None = None  # constrained requests only
    tokens: list[int] = field(default_factory=list)  # generated, end-of-sequence included
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_at: float | None = None
    finish: FinishReason | None = None  # set by the step that ended it

    def output(
        self,
        *,
        cached_tokens: int = 0,
        cache_outcome: CacheOutcome = CacheOutcome.MISS,
        preemptions: int = 0,
    ) -> GenerationOutput:
        """The finished result. A sequence ended outside the step (its engine's own length
        limit, a pool that cannot hold it) ends with LENGTH."""
        stopped = self.finish is FinishReason.STOP
        gen = self.tokens
        if stopped and gen and self.rules.is_eos(gen[-1]):
            gen = gen[:-1]  # the end-of-sequence token is not output
        ttft = None if self.first_token_at is None else self.first_token_at - self.added_at
        return GenerationOutput(
            request_id=self.request.request_id,
            prompt_tokens=len(self.request.prompt_tokens),
            cached_tokens=cached_tokens,
            cache_outcome=cache_outcome,
            token_ids=list(gen),
            finish_reason=FinishReason.STOP if stopped else FinishReason.LENGTH,
            logprobs=self.logprobs if self.request.params.logprobs else None,
            first_token_s=ttft,
            extra={"preemptions": float(preemptions)},
        )


class Postprocessor:
    """The step, shared by an engine's sequences; it counts every token it is given."""

    def __init__(self, sink: TokenSink) -> None:
        self.sink = sink
        self.generated_tokens = 0  # every sampled token, end-of-sequence tokens included

    def __call__(
        self, gen: Generation, token: int, logprob: TokenLogprob | None, now: float
    ) -> FinishReason | None:
        """Take one sampled token of `gen` (its log-prob, or None when not asked for; `now`:
        the engine clock); the reason it finished with, or None while it goes on."""
        self.generated_tokens += 1
        if gen.first_token_at is None:
            gen.first_token_at = now
        gen.tokens.append(token)
        rules = gen.rules
        reason = rules.on_token(token, len(gen.tokens))
        if reason is not FinishReason.STOP:  # an end-of-sequence token is not output
            if logprob is not None:
                gen.logprobs.append(logprob)
            emit = self.sink.on_token
            if emit is not None:
                emit(gen.request.request_id, token)
            reason = grammar_finish(reason, gen.grammar is not None and gen.grammar(token))
            if reason is None and rules.stops:
                if rules.stop_in_tail(gen.tokens, self.sink.tokenizer.decode):
                    reason = FinishReason.STOP
        gen.finish = reason
        return reason
