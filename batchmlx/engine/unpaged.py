"""The unpaged engine: mlx-lm's own continuous batching (`BatchGenerator`) behind EngineProtocol.

For models the paged engine cannot run (engine/choose.py decides): hybrid and state-space caches,
rotations that keep a prefix, attention the paged seam does not fit. mlx-lm batches these with
its own per-architecture caches. What stays the same as the paged engine: each sampled token's
post-processing step (core/postprocess.py: end of sequence, max tokens, grammar, stop strings,
log-probs, streaming callbacks), per-request sampling keyed by (seed, token index) through the
same sampler (engine/sampler.py), log-probs of the raw logits. What it has not: prefix caching,
KV blocks, embeddings. Structured outputs go through an mlx-lm logits processor per constrained
request: it feeds the matcher the token the step consumes (the one sampled last) and masks the
logits the same way the paged engine does.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from batchmlx.core.engine_api import EngineSettings, StepError, TokenCallback, run_to_completion
from batchmlx.core.finish import FinishRules
from batchmlx.core.postprocess import Generation, Postprocessor
from batchmlx.core.request import GenerationOutput, GenerationRequest, TokenLogprob
from batchmlx.core.telemetry import EngineCounters
from batchmlx.core.width import initial_width
from batchmlx.engine.grammar import Grammars
from batchmlx.engine.host.memory import HeapTrimmer, release_free_memory
from batchmlx.engine.sampler import SampleRow, sample
from batchmlx.faults import crash_point

PREFILL_BATCH = 8  # prompts mlx-lm prefills together (its default)


@dataclass(slots=True)
class _Live:
    gen: Generation  # what the post-processing step keeps (core/postprocess.py)
    sampler: Any  # mlx-lm sampler (None: greedy)
    processors: list  # mlx-lm logits processors (the grammar's)
    uid: int | None = None  # mlx-lm's id once admitted into its batch


class UnpagedEngine:
    """EngineProtocol and EngineTelemetry over mlx_lm.generate.BatchGenerator."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        context_length: int,
        config: EngineSettings | None = None,
        clock=time.perf_counter,
        seed: int | None = None,
        batched: bool = True,
    ) -> None:
        """batched False: one request at a time through mlx-lm's single-request loop, for a
        model whose batched caches or attention mlx-lm cannot run correctly (engine/choose.py)."""
        self.cfg = config or EngineSettings()
        self.batched = batched
        self.model = model
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.clock = clock
        self._rand = random.Random(seed)
        vocab = getattr(getattr(model, "args", None), "vocab_size", None)
        self.grammars = Grammars(tokenizer, vocab)  # structured outputs, compiled on first use
        self.heap = HeapTrimmer()  # freed heap pages back to the OS (engine/host/memory.py)
        self._live: dict[str, _Live] = {}  # waiting and running
        self._by_uid: dict[int, str] = {}  # running: in mlx-lm's batch
        self._waiting: list[tuple[int, int, str]] = []  # heap of (priority, order, request id)
        self._order = itertools.count()
        self.width = self.cfg.running_bound if batched else 1
        self._steps = 0  # its own counts (no scheduler); sampled tokens: the post's
        self._step_s = 0.0
        self._added = 0
        self._gen = self._generator()
        self.post = Postprocessor(self)  # each sampled token's one step (core/postprocess.py)
        self.on_token: TokenCallback | None = None

    def _generator(self):
        from mlx_lm.generate import BatchGenerator

        if not self.batched:
            return OneAtATime(self.model, self.cfg.max_prefill_tokens)
        width = self.cfg.running_bound
        return BatchGenerator(
            self.model,
            completion_batch_size=width,
            prefill_batch_size=min(PREFILL_BATCH, width),
            prefill_step_size=self.cfg.max_prefill_tokens,
        )

    # -- EngineProtocol ------------------------------------------------------------------------
    @property
    def max_context_tokens(self) -> int:
        return self.context_length

    def add(self, req: GenerationRequest) -> None:
        """Raises ValueError for a prompt that leaves no room (core/finish.py's one rule)."""
        rules = FinishRules.for_request(req, self.max_context_tokens)
        entropy = self._rand.getrandbits(63)
        sampler = None if req.params.greedy else _row_sampler(req, entropy)
        matcher = self.grammars.matcher(req.grammar) if req.grammar else None
        processors = [_grammar_processor(self.grammars, matcher)] if matcher is not None else []
        # mlx-lm's processor feeds the matcher: the step only asks whether it is complete
        done = None if matcher is None else (lambda _: Grammars.complete(matcher))
        gen = Generation(req, rules, self.clock(), done)
        self._live[req.request_id] = _Live(gen, sampler, processors)
        # admitted by priority (online before batch work), then arrival, as the batch has room
        heapq.heappush(self._waiting, (req.priority, next(self._order), req.request_id))
        self._added += 1

    def abort(self, request_id: str) -> bool:
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        if live.uid is not None:  # a waiting one is skipped when its turn comes
            del self._by_uid[live.uid]
            self._gen.remove([live.uid])
        return True

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def step(self) -> list[GenerationOutput]:
        if not self._live:
            return []
        t0 = time.perf_counter()
        try:
            crash_point("engine_step")
            self._admit()
            _, responses = self._gen.next()
        except Exception as exc:
            ids = list(self._by_uid.values())
            for rid in ids:
                del self._live[rid]
            self._by_uid.clear()
            self._gen = self._generator()  # its batches are in an unknown state
            raise StepError(ids, exc) from exc
        self._steps += 1
        now = self.clock()
        done = [o for r in responses if (o := self._on_response(r, now)) is not None]
        self._step_s += time.perf_counter() - t0
        self.heap.tick()
        return done

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Run requests to completion (tests, benchmarks, scripts)."""
        return run_to_completion(self, requests)

    # -- EngineTelemetry -----------------------------------------------------------------------
    def counters(self) -> EngineCounters:
        return EngineCounters(
            steps=self._steps, step_s=self._step_s, generated_tokens=self.post.generated_tokens,
            misses=self._added, running=len(self._by_uid),
        )  # fmt: skip

    def release_memory(self) -> int:
        """As the paged engine's: freed memory back to the OS."""
        return release_free_memory()

    def generated_so_far(self, request_id: str) -> int:
        live = self._live.get(request_id)
        return 0 if live is None else len(live.gen.tokens)

    @property
    def embedder(self) -> Any:
        """Always refused: the architectures this engine serves are the ones the embedder's
        batched, block-cached passes do not fit (hybrid caches, batch-unsafe attention)."""
        raise ValueError("embeddings are not computed for models on the unpaged engine")

    # -- internals -----------------------------------------------------------------------------
    def _admit(self) -> None:
        while self._waiting and len(self._by_uid) < self.width:
            _, _, rid = heapq.heappop(self._waiting)
            live = self._live.get(rid)
            if live is None:  # aborted while waiting
                continue
            (live.uid,) = self._gen.insert(
                [list(live.gen.request.prompt_tokens)], max_tokens=[live.gen.rules.max_tokens],
                samplers=[live.sampler], logits_processors=[live.processors],
            )  # fmt: skip
            self._by_uid[live.uid] = rid

    def _on_response(self, r: Any, now: float) -> GenerationOutput | None:
        rid = self._by_uid.get(r.uid)
        if rid is None:  # aborted meanwhile
            return None
        live = self._live[rid]
        tok, p = int(r.token), live.gen.request.params
        lp = _logprob(r.logprobs, tok, p.top_logprobs) if p.logprobs else None
        if self.post(live.gen, tok, lp, now) is None and r.finish_reason is None:
            return None
        if r.finish_reason is None:  # ended here, not by mlx-lm: take it out of its batch
            self._gen.remove([live.uid])
        del self._live[rid]
        del self._by_uid[live.uid]
        return live.gen.output()

    @property
    def running_limit(self) -> int:
        """The width the worker claims by: this engine does not adapt its width, so the one a
        fresh engine starts at (EngineProtocol)."""
        return initial_width(self.cfg)


@dataclass(slots=True)
class _Response:
    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None


class OneAtATime:
    """The part of mlx-lm's BatchGenerator interface the engine uses, over its single-request
    loop (`generate_step`, what `mlx_lm.generate` runs): any cache mlx-lm has works here."""

    def __init__(self, model: Any, prefill_step_size: int) -> None:
        self.model = model
        self.prefill_step_size = prefill_step_size
        self._queue: deque[tuple[int, list[int], int, Any, list]] = deque()
        self._uids = 0
        self._current: tuple[int, int, Iterator] | None = None  # uid, tokens left, loop

    def insert(self, prompts, max_tokens, samplers, logits_processors) -> list[int]:
        uids = []
        for args in zip(prompts, max_tokens, samplers, logits_processors, strict=True):
            self._queue.append((self._uids, *args))
            uids.append(self._uids)
            self._uids += 1
        return uids

    def next(self) -> tuple[list, list[_Response]]:
        from mlx_lm.generate import generate_step

        if self._current is None:
            if not self._queue:
                return [], []
            uid, prompt, max_tokens, sampler, processors = self._queue.popleft()
            loop = generate_step(
                mx.array(prompt), self.model, max_tokens=max_tokens, sampler=sampler,
                logits_processors=list(processors) or None,
                prefill_step_size=self.prefill_step_size,
            )  # fmt: skip
            self._current = (uid, max_tokens, loop)
        uid, left, loop = self._current
        token, logprobs = next(loop)
        left -= 1
        self._current = (uid, left, loop) if left else None
        return [], [_Response(uid, int(token), logprobs, None if left else "length")]

    def remove(self, uids: list[int]) -> None:
        gone = set(uids)
        self._queue = deque(q for q in self._queue if q[0] not in gone)
        if self._current is not None and self._current[0] in gone:
            self._current = None

    def close(self) -> None:
        pass


def _row_sampler(req: GenerationRequest, entropy: int) -> Callable[[mx.array], mx.array]:
    """mlx-lm sampler for one sequence that draws as engine/sampler.py does, keyed by
    (seed, token index): the same seed gives the same text in either engine."""
    count = [0]

    def draw(logprobs: mx.array) -> mx.array:  # [1, V] normalized logits
        (tok,), _ = sample(logprobs, [SampleRow(req.params, count[0], entropy)])
        count[0] += 1
        return mx.array([tok], dtype=mx.uint32)

    return draw


def _grammar_processor(
    grammars: Grammars, matcher: Any
) -> Callable[[mx.array, mx.array], mx.array]:
    """mlx-lm logits processor for one constrained sequence. mlx-lm calls it once per sampled
    token with the tokens fed so far: from the second call on, the last of them is the token
    sampled before, which the matcher has not seen yet."""
    calls = [0]

    def constrain(context: mx.array, logits: mx.array) -> mx.array:  # logits [1, V]
        if calls[0]:
            Grammars.advance(matcher, int(context[-1].item()))
        calls[0] += 1
        return grammars.mask(logits, [(matcher, 0)])

    return constrain


def _logprob(row: mx.array, tok: int, top_k: int) -> TokenLogprob:
    lp = np.array(row.astype(mx.float32))
    top: tuple[tuple[int, float], ...] = ()
    if top_k > 0:
        idx = np.argpartition(-lp, top_k - 1)[:top_k]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = tuple((int(j), float(lp[j])) for j in idx)
    return TokenLogprob(token_id=tok, logprob=float(lp[tok]), top=top)
