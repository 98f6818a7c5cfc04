"""The engine core: one step loop for every model, as nano-vllm's `LLMEngine.step()` and vLLM v1's
`EngineCore`: the runner schedules and executes, this loop samples and post-processes.

    step():  runner.execute()            which requests run now and their next-token logits
                                         (its scheduling policy: core/scheduler, or a queue)
             sample                      grammar masks, then engine/sampler.py, one row each
             core/postprocess            finish rules, log-probs, stream callback, grammar
             runner.commit()             the runner's bookkeeping; the requests that ended

What differs between models lives in a runner (engine/runners/): paged text on MLX or the host
backend (runners/paged.py), mlx-lm's own batching or its one-at-a-time loop (runners/mlx_lm.py),
vision-language prompts through mlx-vlm (runners/vision.py). Everything else a request meets
(its finish rules, sampling keyed by seed and token index, the post-processing step, the
failure of a step, the counters the worker reads) is here, once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from batchmlx.core.engine_api import EngineSettings, StepError, TokenCallback, run_to_completion
from batchmlx.core.finish import FinishRules
from batchmlx.core.postprocess import Generation, Postprocessor
from batchmlx.core.request import GenerationOutput, GenerationRequest, TokenLogprob
from batchmlx.core.telemetry import EngineCounters
from batchmlx.engine.grammar import Grammars
from batchmlx.engine.host.memory import HeapTrimmer, release_free_memory
from batchmlx.engine.sampler import SampleRow, sample
from batchmlx.faults import crash_point


@dataclass(slots=True)
class Live:
    """A request the engine holds, from `add` until it ends or is aborted."""

    gen: Generation  # what the post-processing step keeps (core/postprocess.py)
    entropy: int  # stands in for the seed when the request gives none
    matcher: Any = None  # llguidance matcher of a constrained request
    slot: Any = None  # the runner's own state of this request

    @property
    def request_id(self) -> str:
        return self.gen.request.request_id


@dataclass(slots=True)
class Ran:
    """One executed step: the requests that sampled a token in it, in row order, and either the
    logits to sample from (the core samples) or the tokens the runner's library sampled."""

    lives: list[Live]
    logits: Any = None  # mx.array [len(lives), V]
    tokens: list[int] | None = None
    logprobs: list[TokenLogprob | None] | None = None
    state: Any = None  # the runner's own record of the step, for commit


@dataclass(frozen=True, slots=True)
class Ended:
    """A request that ended in a step, and what its output reports of the cache."""

    live: Live
    extras: dict[str, Any] = field(default_factory=dict)  # Generation.output's keywords


class Runner(Protocol):
    """What a model runner gives the core: a scheduling policy and a forward step."""

    tokenizer: Any
    # the runner's library samples (mlx-lm's BatchGenerator): the core post-processes its tokens
    # and a grammar's matcher is fed by the library (logits processors), not by the core
    samples_itself: bool

    @property
    def max_context_tokens(self) -> int: ...

    @property
    def running_limit(self) -> int: ...

    def admit(self, live: Live) -> None:
        """Queue a request the core accepted."""

    def drop(self, live: Live) -> None:
        """Forget an aborted request, freeing what it holds."""

    def execute(self) -> Ran | None:
        """Schedule and run one step; None when there was nothing to run."""

    def commit(self, ran: Ran, sampled: list[int], finished: set[str]) -> list[Ended]:
        """Record the step (its sampled tokens, the requests the post-processing ended);
        every request that ended in it, those the runner ended itself too."""

    def fail(self) -> tuple[list[str], bool] | None:
        """After a step raised: the requests it ran, and whether the runner dropped them
        (its own state of them is unknown; the core then forgets them too); None when the
        failure was not in a step's work (the error goes to the worker as it is)."""

    def counters(self, steps: int, step_s: float, generated: int) -> EngineCounters: ...

    @property
    def embedder(self) -> Any: ...


class EngineCore:
    """EngineProtocol and EngineTelemetry over one runner."""

    def __init__(
        self,
        runner: Runner,
        *,
        config: EngineSettings | None = None,
        grammars: Grammars | None = None,
        clock: Callable[[], float] = time.perf_counter,
        seed: int | None = None,
    ) -> None:
        self.cfg = config or EngineSettings()
        self.runner = runner
        self.clock = clock
        self._rand = random.Random(seed)
        self.grammars = grammars  # structured outputs (None: the model takes none)
        self.heap = HeapTrimmer()  # freed heap pages back to the OS (engine/host/memory.py)
        self.post = Postprocessor(self)  # each sampled token's one step (core/postprocess.py)
        self._live: dict[str, Live] = {}
        self.steps = 0  # steps that ran something
        self.step_s = 0.0  # their wall time
        self.sample_s = 0.0  # of which choosing tokens from the logits
        # called with (request_id, token_id) for every token a request emits (streaming)
        self.on_token: TokenCallback | None = None

    @property
    def tokenizer(self) -> Any:
        """Decodes a request's tail for its stop strings (tests swap it)."""
        return self.runner.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self.runner.tokenizer = tokenizer

    # -- EngineProtocol ------------------------------------------------------------------------
    @property
    def max_context_tokens(self) -> int:
        return self.runner.max_context_tokens

    @property
    def running_limit(self) -> int:
        """The running width batch work is admitted up to now (the worker claims by it)."""
        return self.runner.running_limit

    def add(self, req: GenerationRequest) -> None:
        """Raises ValueError for a prompt that leaves no room (core/finish.py's one rule)."""
        rules = FinishRules.for_request(req, self.max_context_tokens)
        added_at, entropy = self.clock(), self._rand.getrandbits(63)
        matcher = None
        if req.grammar:
            if self.grammars is None:
                raise ValueError("this model takes no structured outputs")
            matcher = self.grammars.matcher(req.grammar)
        grammar = None
        if matcher is not None:  # the library feeds its matcher: the step only asks if done
            advance = Grammars.advance if not self.runner.samples_itself else _complete
            grammar = partial(advance, matcher)
        live = Live(Generation(req, rules, added_at, grammar), entropy, matcher)
        self._live[req.request_id] = live
        self.runner.admit(live)

    def abort(self, request_id: str) -> bool:
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        self.runner.drop(live)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def generated_so_far(self, request_id: str) -> int:
        """Tokens a running request has generated (0 once it is done or unknown)."""
        live = self._live.get(request_id)
        return 0 if live is None else len(live.gen.tokens)

    def step(self) -> list[GenerationOutput]:
        if not self._live:
            return []
        t0 = time.perf_counter()
        try:
            ran = self.runner.execute()
            if ran is None:
                return []
            crash_point("engine_step")  # a step that fails with work in hand
            tokens, lps = self._sample(ran)
            now = self.clock()
            finished = set()
            for live, tok, lp in zip(ran.lives, tokens, lps, strict=True):
                if self.post(live.gen, tok, lp, now) is not None:
                    finished.add(live.request_id)
            ended = self.runner.commit(ran, tokens, finished)
        except Exception as exc:
            failed = self.runner.fail()
            if failed is None:
                raise
            ids, dropped = failed
            if dropped:
                for rid in ids:
                    self._live.pop(rid, None)
            raise StepError(ids, exc) from exc
        self.steps += 1
        self.step_s += time.perf_counter() - t0
        self.heap.tick()
        outputs = []
        for e in ended:
            self._live.pop(e.live.request_id, None)
            outputs.append(e.live.gen.output(**e.extras))
        return outputs

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Run requests to completion (tests, benchmarks, scripts)."""
        return run_to_completion(self, requests)

    # -- EngineTelemetry -----------------------------------------------------------------------
    def counters(self) -> EngineCounters:
        """Read once per step by the worker's metrics."""
        return self.runner.counters(self.steps, self.step_s, self.post.generated_tokens)

    @property
    def embedder(self) -> Any:
        """Mean-pooled embeddings of the same model (engine/embed.py); ValueError where the
        runner has none."""
        return self.runner.embedder

    def release_memory(self) -> int:
        """Freed memory back to the OS (MLX's buffer cache, the heap's free pages), after a
        large one-off piece of work or when idle: bytes MLX's cache held."""
        return release_free_memory()

    # -- internals -----------------------------------------------------------------------------
    def _sample(self, ran: Ran) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row: the runner's own, or the logits' with each grammar's mask."""
        if ran.tokens is not None:
            return ran.tokens, list(ran.logprobs or [None] * len(ran.tokens))
        if not ran.lives:  # prompt chunks that sample nothing
            return [], []
        t0 = time.perf_counter()
        rows, constrained = [], []
        for j, live in enumerate(ran.lives):
            rows.append(SampleRow(live.gen.request.params, len(live.gen.tokens), live.entropy))
            if live.matcher is not None:
                constrained.append((live.matcher, j))
        logits = ran.logits
        if constrained:
            assert self.grammars is not None
            logits = self.grammars.mask(logits, constrained)
        tokens, lps = sample(logits, rows)
        self.sample_s += time.perf_counter() - t0
        return tokens, lps


def _complete(matcher: Any, token: int) -> bool:
    del token  # the library's logits processor fed it already
    return Grammars.complete(matcher)
