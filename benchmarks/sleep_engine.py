"""An engine that takes a fixed wall time per step and no CPU: a stand-in for a worker host with
its own accelerator, so that several workers on one small machine measure the queue, not the
machine's cores. Implements core.engine_api.EngineProtocol: up to max_batch_size requests run,
each step sleeps `step_s` and gives every running request one token, a request ends at its
max_tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from batchmlx.core.engine_api import EngineSettings, TokenCallback
from batchmlx.core.finish import max_new_tokens
from batchmlx.core.request import CacheOutcome, FinishReason, GenerationOutput, GenerationRequest
from batchmlx.core.telemetry import EngineCounters
from batchmlx.core.width import initial_width
from batchmlx.worker.build import EngineFactory, ServingModel
from batchmlx.worker.translate import Translator

STEP_S = 0.020  # one decode step of a small model on an accelerator, roughly
VOCAB = 26


class CharTokenizer:
    """Characters to token ids and back; a chat template that joins the contents."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        del add_special_tokens
        return [ord(c) % VOCAB for c in text] or [0]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % VOCAB) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False) -> str:
        del add_generation_prompt, tokenize
        return "|".join(str(m.get("content", "")) for m in messages)


@dataclass(slots=True)
class _Running:
    req: GenerationRequest
    tokens: list[int] = field(default_factory=list)


class SleepEngine:
    def __init__(self, settings: EngineSettings, step_s: float = STEP_S) -> None:
        self.settings, self.step_s = settings, step_s
        self.on_token: TokenCallback | None = None
        self.waiting: list[GenerationRequest] = []
        self.running: list[_Running] = []

    @property
    def max_context_tokens(self) -> int:
        return 4096

    def add(self, req: GenerationRequest) -> None:
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: r.priority)  # stable: arrival order within a priority

    def abort(self, request_id: str) -> bool:
        before = len(self.waiting) + len(self.running)
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        self.running = [r for r in self.running if r.req.request_id != request_id]
        return len(self.waiting) + len(self.running) < before

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[GenerationOutput]:
        while self.waiting and len(self.running) < self.settings.running_bound:
            self.running.append(_Running(self.waiting.pop(0)))
        time.sleep(self.step_s)  # the accelerator's work: wall time, no CPU of this host
        done = []
        for r in list(self.running):
            tok = (r.req.prompt_tokens[-1] + len(r.tokens) + 1) % VOCAB
            r.tokens.append(tok)
            if self.on_token is not None:
                self.on_token(r.req.request_id, tok)
            if len(r.tokens) >= max_new_tokens(
                r.req.params.max_tokens, len(r.req.prompt_tokens), self.max_context_tokens
            ):
                self.running.remove(r)
                done.append(GenerationOutput(
                    request_id=r.req.request_id, prompt_tokens=len(r.req.prompt_tokens),
                    cached_tokens=0, cache_outcome=CacheOutcome.MISS, token_ids=r.tokens,
                    finish_reason=FinishReason.LENGTH,
                ))  # fmt: skip
        return done

    @property
    def running_limit(self) -> int:
        return initial_width(self.settings)  # a fixed width

    def generated_so_far(self, request_id: str) -> int:
        return next((len(r.tokens) for r in self.running if r.req.request_id == request_id), 0)

    def counters(self) -> EngineCounters:
        return EngineCounters(running=len(self.running))


def sleep_engine_factory(settings: EngineSettings, step_s: float = STEP_S) -> EngineFactory:
    def build(name: str) -> ServingModel:
        engine = SleepEngine(settings, step_s)
        return ServingModel(name, engine, Translator(CharTokenizer(), "sleep-engine",
                                                     engine.max_context_tokens, []))  # fmt: skip

    return build
