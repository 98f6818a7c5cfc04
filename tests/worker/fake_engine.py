"""A pure-Python engine for worker tests: deterministic tokens, no model, microseconds a step.

It keeps the scheduler's contract as the worker sees it: requests wait in (priority, arrival)
order, at most `max_batch_size` run, each running request gets one token per step, and a
request the test marks for preemption is sent back to waiting once (its tokens recomputed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchmlx.core.engine_api import EngineSettings, TokenCallback
from batchmlx.core.finish import max_new_tokens
from batchmlx.core.request import (
    CacheOutcome,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
)
from batchmlx.core.telemetry import EngineCounters
from batchmlx.core.width import initial_width
from batchmlx.worker.build import ServingModel
from batchmlx.worker.translate import Translator

VOCAB = 26  # tokens 0..25 decode to "a".."z"


class FakeTokenizer:
    """Characters → token ids and back; a chat template that joins the contents."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        del add_special_tokens
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % VOCAB) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False) -> str:
        del add_generation_prompt, tokenize
        return "|".join(str(m.get("content", "")) for m in messages)


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """What the fake generates: the prompt's last token + 1, + 2, … (mod VOCAB)."""
    return [(prompt[-1] + i + 1) % VOCAB for i in range(n)]


@dataclass
class _Run:
    req: GenerationRequest
    order: int
    tokens: list[int] = field(default_factory=list)


class FakeEngine:
    def __init__(
        self,
        settings: EngineSettings,
        *,
        context: int = 256,
        preempt: frozenset[tuple[int, ...]] = frozenset(),
    ) -> None:
        self.settings = settings
        self.context = context
        self.on_token: TokenCallback | None = None
        self.waiting: list[_Run] = []
        self.running: list[_Run] = []
        self.preempt = set(preempt)  # prompts (token tuples) sent back to waiting once
        self.admitted: list[str] = []  # request ids in admission order (re-admissions too)
        self.priorities: dict[str, int] = {}  # request id -> the priority it was added with
        self.preempted: list[str] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.max_running = 0
        self.max_held = 0  # waiting + running
        self._order = 0

    @property
    def max_context_tokens(self) -> int:
        return self.context

    def add(self, req: GenerationRequest) -> None:
        if not req.prompt_tokens:
            raise ValueError("empty prompt")
        self._order += 1
        self.priorities[req.request_id] = req.priority
        self.waiting.append(_Run(req, self._order))
        self.max_held = max(self.max_held, len(self.waiting) + len(self.running))

    def abort(self, request_id: str) -> bool:
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.req.request_id == request_id:
                    queue.remove(r)
                    self.aborted.append(request_id)
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[GenerationOutput]:
        self.steps += 1
        self.waiting.sort(key=lambda r: (r.req.priority, r.order))
        while self.waiting and len(self.running) < self.settings.running_bound:
            r = self.waiting.pop(0)
            self.admitted.append(r.req.request_id)
            self.running.append(r)
        self.max_running = max(self.max_running, len(self.running))
        done: list[GenerationOutput] = []
        for r in list(self.running):
            tok = expected_tokens(r.req.prompt_tokens, len(r.tokens) + 1)[-1]
            r.tokens.append(tok)
            if self.on_token is not None:
                self.on_token(r.req.request_id, tok)
            prompt = tuple(r.req.prompt_tokens)
            if prompt in self.preempt:  # back to waiting: its tokens are recomputed
                self.preempt.discard(prompt)
                self.preempted.append(r.req.request_id)
                self.running.remove(r)
                r.tokens.clear()
                self.waiting.append(r)
                continue
            limit = max_new_tokens(r.req.params.max_tokens, len(prompt), self.context)
            if len(r.tokens) >= limit:
                self.running.remove(r)
                done.append(
                    GenerationOutput(
                        request_id=r.req.request_id,
                        prompt_tokens=len(r.req.prompt_tokens),
                        cached_tokens=0,
                        cache_outcome=CacheOutcome.MISS,
                        token_ids=list(r.tokens),
                        finish_reason=FinishReason.LENGTH,
                    )
                )
        return done

    @property
    def running_limit(self) -> int:
        return initial_width(self.settings)  # a fake of fixed width

    def generated_so_far(self, request_id: str) -> int:
        for r in self.running:
            if r.req.request_id == request_id:
                return len(r.tokens)
        return 0

    def counters(self) -> EngineCounters:
        return EngineCounters(steps=self.steps, running=len(self.running))


def fake_factory(engines: list[FakeEngine], settings: EngineSettings, **kw):
    """An engine factory for Worker: each build makes a FakeEngine and appends it to `engines`."""

    def build(name: str) -> ServingModel:
        engine = FakeEngine(settings, **kw)
        engines.append(engine)
        translator = Translator(FakeTokenizer(), "fake-model", engine.max_context_tokens, [])
        return ServingModel(name, engine, translator)

    return build
