"""mlx-lm's own batching (`BatchGenerator`), or its one-at-a-time loop, as a Runner.

For models the paged runner cannot run (engine/choose.py decides): hybrid and state-space
caches, rotations that keep a prefix, attention the paged seam does not fit. mlx-lm batches
these with its own per-architecture caches; its scheduling policy here is a queue by priority
(online before batch work), then arrival. What the engine core gives it as to every runner:
each sampled token's post-processing step (core/postprocess.py), per-request sampling keyed by
(seed, token index) through the same sampler (engine/sampler.py; mlx-lm calls it per row),
log-probs of the raw logits. What it has not: prefix caching, KV blocks, embeddings. Structured
outputs go through an mlx-lm logits processor per constrained request: it feeds the matcher the
token the step consumes (the one sampled last) and masks the logits as the core does.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.request import GenerationRequest, TokenLogprob
from batchmlx.core.telemetry import EngineCounters
from batchmlx.core.width import initial_width
from batchmlx.engine.core import Ended, EngineCore, Live, Ran
from batchmlx.engine.grammar import Grammars
from batchmlx.engine.sampler import SampleRow, sample

PREFILL_BATCH = 8  # prompts mlx-lm prefills together (its default)


@dataclass(slots=True)
class _Slot:
    sampler: Any  # mlx-lm sampler (None: greedy)
    processors: list  # mlx-lm logits processors (the grammar's)
    uid: int | None = None  # mlx-lm's id once admitted into its batch


class MlxLmRunner:
    """The Runner (engine/core.py) over mlx_lm.generate.BatchGenerator (or OneAtATime)."""

    samples_itself = True

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        context_length: int,
        config: EngineSettings,
        grammars: Grammars,
        batched: bool = True,
    ) -> None:
        """batched False: one request at a time through mlx-lm's single-request loop, for a
        model whose batched caches or attention mlx-lm cannot run correctly (choose.py)."""
        self.cfg = config
        self.batched = batched
        self.model = model
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.grammars = grammars
        self._by_uid: dict[int, Live] = {}  # running: in mlx-lm's batch
        self._waiting: list[tuple[int, int, str]] = []  # heap of (priority, order, request id)
        self._queued: dict[str, Live] = {}  # waiting, by request id (aborted ones leave it)
        self._order = itertools.count()
        self.width = self.cfg.running_bound if batched else 1
        self._added = 0
        self._ending: list[Ended] = []  # ended in a commit under way
        self._gen = self._generator()

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

    # -- Runner --------------------------------------------------------------------------------
    @property
    def max_context_tokens(self) -> int:
        return self.context_length

    @property
    def running_limit(self) -> int:
        """The width the worker claims by: this runner does not adapt its width, so the one a
        fresh engine starts at (EngineProtocol)."""
        return initial_width(self.cfg)

    def admit(self, live: Live) -> None:
        req = live.gen.request
        sampler = None if req.params.greedy else _row_sampler(req, live.entropy)
        matcher = live.matcher
        processors = [_grammar_processor(self.grammars, matcher)] if matcher is not None else []
        live.slot = _Slot(sampler, processors)
        self._queued[req.request_id] = live
        # admitted by priority (online before batch work), then arrival, as the batch has room
        heapq.heappush(self._waiting, (req.priority, next(self._order), req.request_id))
        self._added += 1

    def drop(self, live: Live) -> None:
        self._queued.pop(live.request_id, None)  # a waiting one is skipped when its turn comes
        uid = live.slot.uid
        if uid is not None and uid in self._by_uid:
            del self._by_uid[uid]
            self._gen.remove([uid])

    def execute(self) -> Ran | None:
        self._admit()
        _, responses = self._gen.next()
        lives, tokens, lps, ends = [], [], [], []
        for r in responses:
            live = self._by_uid.get(r.uid)
            if live is None:  # aborted meanwhile
                continue
            tok, p = int(r.token), live.gen.request.params
            lives.append(live)
            tokens.append(tok)
            lps.append(_logprob(r.logprobs, tok, p.top_logprobs) if p.logprobs else None)
            ends.append(r.finish_reason is not None)
        return Ran(lives, tokens=tokens, logprobs=lps, state=ends)

    def commit(self, ran: Ran, sampled: list[int], finished: set[str]) -> list[Ended]:
        self._ending = ended = []  # fail() names them too, should a later removal raise
        for live, library_ended in zip(ran.lives, ran.state, strict=True):
            if live.request_id not in finished and not library_ended:
                continue
            ended.append(Ended(live))
            del self._by_uid[live.slot.uid]
            if not library_ended:  # ended here, not by mlx-lm: take it out of its batch
                self._gen.remove([live.slot.uid])
        self._ending = []
        return ended

    def fail(self) -> tuple[list[str], bool]:
        ids = [e.live.request_id for e in self._ending]
        ids += [live.request_id for live in self._by_uid.values()]
        self._by_uid.clear()
        self._ending = []
        self._gen = self._generator()  # its batches are in an unknown state
        return ids, True

    def counters(self, steps: int, step_s: float, generated: int) -> EngineCounters:
        return EngineCounters(
            steps=steps, step_s=step_s, generated_tokens=generated, misses=self._added,
            running=len(self._by_uid),
        )  # fmt: skip

    @property
    def embedder(self) -> Any:
        """Always refused: the architectures this runner serves are the ones the embedder's
        batched, block-cached passes do not fit (hybrid caches, batch-unsafe attention)."""
        raise ValueError("embeddings are not computed for models on the unpaged engine")

    # -- internals -----------------------------------------------------------------------------
    def _admit(self) -> None:
        while self._waiting and len(self._by_uid) < self.width:
            _, _, rid = heapq.heappop(self._waiting)
            live = self._queued.pop(rid, None)
            if live is None:  # aborted while waiting
                continue
            (live.slot.uid,) = self._gen.insert(
                [list(live.gen.request.prompt_tokens)], max_tokens=[live.gen.rules.max_tokens],
                samplers=[live.slot.sampler], logits_processors=[live.slot.processors],
            )  # fmt: skip
            self._by_uid[live.slot.uid] = live


def mlx_lm_engine(
    model: Any,
    tokenizer: Any,
    *,
    context_length: int,
    config: EngineSettings | None = None,
    clock=time.perf_counter,
    seed: int | None = None,
    batched: bool = True,
) -> EngineCore:
    """The engine core over mlx-lm's own batching (batched False: its one-at-a-time loop)."""
    cfg = config or EngineSettings()
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    grammars = Grammars(tokenizer, vocab)  # structured outputs, compiled on first use
    runner = MlxLmRunner(
        model, tokenizer, context_length=context_length, config=cfg, grammars=grammars,
        batched=batched,
    )  # fmt: skip
    return EngineCore(runner, config=cfg, grammars=grammars, clock=clock, seed=seed)


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
