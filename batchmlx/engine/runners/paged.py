"""Paged text: core/scheduler decides, a forward pass over the paged KV pool executes.

The runner for every model whose attention fits the paged seam (engine/choose.py): mlx-lm's
model code on MLX, or the host backend's forward pass for llama-family models in a host weight
format (runners/paged_forward.py picks per step). Prefix sharing, mixed prefill/decode steps,
the decodes' dense KV copy and the adaptive running width live here; sampling and each token's
post-processing are the engine core's (engine/core.py). Simple mode is the same runner with one
sequence at a time (max_batch_size 1), so both give the same tokens for the same request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import mlx.core as mx

from batchmlx.core.blocks import BlockPool
from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.kv_manager import blocks_for
from batchmlx.core.request import CacheOutcome
from batchmlx.core.scheduler import Scheduler, SchedulerConfig, SchedulerStats, SchedulerStep
from batchmlx.core.sequence import Sequence
from batchmlx.core.telemetry import EngineCounters
from batchmlx.core.width import StepReport, WidthController, WidthPhase, WidthPolicy
from batchmlx.engine.core import Ended, EngineCore, Live, Ran
from batchmlx.engine.embed import Embedder
from batchmlx.engine.grammar import Grammars
from batchmlx.engine.host.step import pool_dtype as host_pool_dtype
from batchmlx.engine.kv.budget import kv_block_budget, size_buffer_cache
from batchmlx.engine.kv.decode import BUDGET_BYTES as DECODE_KV_BUDGET
from batchmlx.engine.kv.decode import DecodeKV
from batchmlx.engine.kv.paged import KEY_GROUP, BatchLayout, PackedLayout, PagedKVStorage
from batchmlx.engine.runners.paged_forward import PagedForward, model_dims

# A KV pool growth makes room for this many more tokens of every running sequence at most (or
# up to its max_tokens): one growth serves a batch of 128-token answers, and a request without
# max_tokens, whose limit is the context, does not take the whole KV bound at once
FORECAST_TOKENS = 128


@dataclass(slots=True)
class EngineStats:
    """The paged runner's own measures. Step counts are the scheduler's, sampled tokens the
    post-processing step's and step times the engine core's: kept there once, read here."""

    scheduler: SchedulerStats
    core: EngineCore
    kv_bound_bytes: int
    peak_kv_bytes: int = 0  # largest KV storage actually allocated
    peak_decode_kv_bytes: int = 0  # largest dense copy of the decodes' KV (kv/decode.py)
    bound_violations: int = 0  # steps where allocated KV exceeded the bound (should stay 0)
    model_s: float = 0.0  # wall time in the model forward (graph built and evaluated)

    steps = property(attrgetter("scheduler.steps"))
    prefill_steps = property(attrgetter("scheduler.prefill_steps"))
    decode_steps = property(attrgetter("scheduler.decode_steps"))
    mixed_steps = property(attrgetter("scheduler.mixed_steps"))  # decodes and prompt chunks
    generated_tokens = property(attrgetter("core.post.generated_tokens"))
    sample_s = property(attrgetter("core.sample_s"))  # choosing tokens from the logits
    step_s = property(attrgetter("core.step_s"))  # whole steps (scheduling to post-processing)

    def as_dict(self) -> dict[str, Any]:
        counted = ("steps", "prefill_steps", "decode_steps", "mixed_steps", "generated_tokens")
        own = [k for k in self.__slots__ if k not in ("scheduler", "core")]
        return {k: getattr(self, k) for k in (*counted, *own, "sample_s", "step_s")}


class PagedRunner:
    """The Runner (engine/core.py) over core/scheduler and the paged KV pool."""

    samples_itself = False

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        context_length: int,
        config: EngineSettings,
        clock=time.perf_counter,
        sliding_window: int | None = None,
    ) -> None:
        """sliding_window: the model has layers that see only that many keys (choose.py):
        their masks are limited to it, and steps never use cascade attention (whose
        shared-prefix part has no mask)."""
        self.cfg = cfg = config
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.clock = clock
        self.sliding_window = sliding_window
        size_buffer_cache()
        num_layers, n_kv, head_dim = model_dims(model)
        # host steps in the int8 and bf16 formats keep a float16 pool (engine/host/step.py)
        dtype = host_pool_dtype(model) or _kv_dtype(model)
        per_block = PagedKVStorage.bytes_per_block(
            num_layers, n_kv, head_dim, cfg.block_size, dtype
        )
        num_blocks = kv_block_budget(cfg, per_block)
        kv_bound = num_blocks * per_block
        self.storage = PagedKVStorage(
            num_layers=num_layers,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            block_size=cfg.block_size,
            dtype=dtype,
            max_blocks=num_blocks,
            grow_blocks=cfg.kv_grow_blocks,
        )
        self.pool = BlockPool(num_blocks, cfg.block_size)
        self.pool.backed_blocks = self.storage.capacity_blocks  # reuse before growing
        self.forward_pass = PagedForward(model, self.storage)
        # mixed steps need the packed layout: padded, one prompt chunk would cost every decode
        # row its length (a model without the attention seam, or with sliding-window layers
        # whose steps run in MLX, keeps prefill-or-decode steps; the host step masks windows)
        fp = self.forward_pass
        self.mixed_steps = (
            cfg.mixed_steps and fp.packs and (sliding_window is None or fp.packs_windows)
        )
        # the decodes' KV kept contiguous (packed steps only), in at most half the KV bound
        # and at most decode.BUDGET_BYTES
        self.decode_kv = (
            DecodeKV(
                self.storage,
                budget_bytes=min(kv_bound // 2, DECODE_KV_BUDGET),
                key_group=KEY_GROUP if self.forward_pass.host is not None else 1,
            )  # fmt: skip
            if self.mixed_steps and cfg.dense_decode and not self._attends_from_pool()
            else None
        )
        # host steps, made batch-invariant: a prompt cut by the step's budget ends where the
        # host's attention tiles end, and a preempted sequence resumes as it ran (core/schedule.py)
        exact = self.mixed_steps and self.forward_pass.host is not None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batch_size=cfg.running_bound,
                block_size=cfg.block_size,
                num_blocks=num_blocks,
                max_prefill_tokens=cfg.max_prefill_tokens,
                enable_prefix_cache=cfg.use_paged_cache,
                prefix_grouping=cfg.prefix_grouping,
                mixed_steps=self.mixed_steps,
                batch_prefill_beside_online=cfg.batch_prefill_beside_online,
                serves_online=cfg.serves_online,
                batch_decodes_beside_online=cfg.batch_decodes_beside_online,
                online_linger_s=cfg.online_linger_s,
                online_step_ratio=cfg.online_step_ratio,
                priority_aging_s=cfg.priority_aging_s,
                chunk_align=_tile_queries() if exact else 1,
                replay_decodes=exact,
            ),
            self.pool,
            clock=clock,
        )
        self.kv_bound = kv_bound
        self.stats: EngineStats | None = None  # made by attach(), which gives the post step
        # the running width of queued work, sized by measured throughput and KV memory
        self.width: WidthController | None = None
        if cfg.adaptive_width and not cfg.simple:
            self.width = WidthController(WidthPolicy(cap=cfg.running_bound))
            self.scheduler.running_limit = self.width.limit
        self._memory_preemptions = 0
        self._embedder: Embedder | None = None
        self._lives: dict[str, Live] = {}
        self._step: SchedulerStep | None = None  # the step being run (for fail)
        self._started = 0.0

    def attach(self, core: EngineCore) -> None:
        """The measures that read the core's post-processing step."""
        self.stats = EngineStats(self.scheduler.stats, core, self.kv_bound)

    # -- Runner --------------------------------------------------------------------------------
    @property
    def pool_blocks(self) -> int:
        return self.storage.max_blocks

    @property
    def max_context_tokens(self) -> int:
        """Prompt plus generated tokens one sequence may reach: the model's context, or the KV
        pool when that is smaller."""
        return min(self.context_length, (self.pool_blocks - 1) * self.cfg.block_size)

    @property
    def running_limit(self) -> int:
        return self.scheduler.running_limit

    def admit(self, live: Live) -> None:
        self._lives[live.request_id] = live
        self.scheduler.add(live.gen.request)

    def drop(self, live: Live) -> None:
        self._lives.pop(live.request_id, None)
        self.scheduler.abort(live.request_id)

    def execute(self) -> Ran | None:
        self._started = self.clock()  # the width controller's time (tests pass a fake clock)
        self._step = step = self.scheduler.schedule()
        if step is None:
            return None
        lives = [self._lives[s.seq.seq_id] for s in step.seqs if s.samples]
        if not step.seqs:
            return Ran([], state=step)
        rows = [i for i, s in enumerate(step.seqs) if s.samples]
        logits = self._forward(step, rows)
        return Ran(lives, logits if rows else None, state=step)

    def commit(self, ran: Ran, sampled: list[int], finished: set[str]) -> list[Ended]:
        step: SchedulerStep = ran.state
        tokens = {live.request_id: tok for live, tok in zip(ran.lives, sampled, strict=True)}
        done = self.scheduler.update(step, tokens, finished)
        self._step = None
        # sequences the scheduler ended itself (the pool cannot hold them even alone)
        ended = [self._ended(seq) for seq in [*step.finished, *done]]
        if self.width is not None:
            self._size_width(len(tokens), self.clock() - self._started, step.paused)
        return ended

    def fail(self) -> tuple[list[str], bool] | None:
        step, self._step = self._step, None
        if step is None:  # not in a step's work (scheduling, or after the update)
            return None
        return [s.seq.seq_id for s in step.seqs], False  # the worker aborts them: freed then

    def counters(self, steps: int, step_s: float, generated: int) -> EngineCounters:
        sched, pool = self.scheduler.stats, self.pool
        return EngineCounters(
            steps=sched.steps, step_s=step_s, generated_tokens=generated,
            preemptions=sched.preemptions, hits=sched.hits, prefix_hits=sched.prefix_hits,
            misses=sched.misses, running=len(self.scheduler.running),
            blocks_in_use=pool.num_used, blocks_cached=pool.num_cached, blocks_free=pool.num_free,
        )  # fmt: skip

    @property
    def embedder(self) -> Embedder:
        """Mean-pooled embeddings of the same model (engine/embed.py)."""
        if self._embedder is None:
            self._embedder = Embedder(self.forward_pass.model)
        return self._embedder

    # -- internals -----------------------------------------------------------------------------
    def _ended(self, seq: Sequence) -> Ended:
        live = self._lives.pop(seq.seq_id)
        extras = {
            "cached_tokens": seq.num_cached_tokens,
            "cache_outcome": seq.cache_outcome or CacheOutcome.MISS,
            "preemptions": seq.num_preemptions,
        }
        return Ended(live, extras)

    def _size_width(self, generated: int, seconds: float, paused: int) -> None:
        sched = self.scheduler
        memory = sched.stats.preemptions - sched.stats.urgent_preemptions
        preempted, self._memory_preemptions = memory - self._memory_preemptions, memory
        assert self.width is not None
        queued = queued_blocks = 0
        if sched.waiting and self.width.phase is WidthPhase.GROWING:  # it may admit them all
            bs = self.cfg.block_size
            for seq in sched.waiting:
                longest = seq.num_prompt_tokens + self._lives[seq.seq_id].gen.rules.max_tokens
                queued += 1
                queued_blocks += blocks_for(longest, bs)
        self.width.observe(StepReport(
            # decodes paused beside online work do not count toward the width's rate
            generated=generated, seconds=seconds, running=len(sched.running) - paused,
            waiting=bool(sched.waiting), blocks_used=self.pool.num_used,
            blocks_total=self.pool.num_usable, preempted=preempted, queued=queued,
            queued_blocks=queued_blocks,
        ))  # fmt: skip
        sched.running_limit = self.width.admission_limit(sched.online_running())

    def _forward(self, step: SchedulerStep, rows: list[int]) -> mx.array:
        """The logits of `rows` (indices into step.seqs), evaluated with the KV they wrote."""
        st = self.stats
        assert st is not None
        chunks, starts, tables = [], [], []
        max_block = 0
        for s in step.seqs:
            seq = s.seq
            chunks.append(seq.token_ids[s.start : s.start + s.num_new_tokens])
            starts.append(s.start)
            tables.append(seq.block_table)
            if seq.block_table:
                max_block = max(max_block, max(seq.block_table))
        if max_block >= self.storage.capacity_blocks:
            self.storage.ensure_capacity(max_block + 1, self._kv_forecast())
            self.pool.backed_blocks = self.storage.capacity_blocks
        # mixed steps run packed: a step costs its real tokens, not B x its longest chunk
        # a shared prefix attended once for all (cascade): not with sliding windows (its
        # prefix part has no mask) or where turned off (batch invariance)
        share = self.sliding_window is None and self.cfg.cascade_attention
        shape = dict(block_size=self.cfg.block_size, n_kv_heads=self.storage.n_kv_heads,
                     token_chunks=chunks, starts=starts, block_tables=tables,
                     share_prefix=share)  # fmt: skip
        # host steps: laid out for batch invariance (kv/paged.py, PackedLayout.build), a
        # one-token prompt chunk as a chunk, not as a decode row
        host = self.mixed_steps and self.forward_pass.host is not None
        prompts = frozenset(i for i, s in enumerate(step.seqs) if host and not s.decode)
        if self.mixed_steps:
            layout = PackedLayout.build(**shape, host=host, prompts=prompts)
        else:
            layout = BatchLayout.build(**shape)
        dense = self.decode_kv
        if dense is not None:
            dense.attach(layout, [s.seq.seq_id for s in step.seqs], chunks, starts, tables,
                         prompts)  # fmt: skip
        t0 = time.perf_counter()
        try:
            logits = self.forward_pass.forward(layout, rows)
            mx.eval(logits, self.storage.keys, self.storage.values,
                    [] if dense is None else dense.arrays())  # fmt: skip
        except BaseException:
            if dense is not None:
                dense.reset()  # it may hold this step's plan half done
            raise
        st.model_s += time.perf_counter() - t0
        st.peak_kv_bytes = max(st.peak_kv_bytes, self.storage.nbytes)
        if dense is not None:
            st.peak_decode_kv_bytes = max(st.peak_decode_kv_bytes, dense.nbytes)
        if self.storage.nbytes > st.kv_bound_bytes:
            st.bound_violations += 1
        return logits

    def _attends_from_pool(self) -> bool:
        """Host steps whose decode rows read the paged pool directly (engine/host/
        paged_attention.py) need no dense copy; the MLX path's decodes still do."""
        host = self.forward_pass.host
        return host is not None and host.attends_from_pool

    def _kv_forecast(self) -> int:
        """Block ids the running sequences may need soon: those handed out so far and each
        one's blocks still to come in its next FORECAST_TOKENS tokens at most, or up to its
        max_tokens (an upper bound: some stop early, and freed blocks are reused first)."""
        bs = self.cfg.block_size
        more = 0
        for seq in self.scheduler.running:
            longest = seq.num_prompt_tokens + self._lives[seq.seq_id].gen.rules.max_tokens
            soon = min(longest, seq.num_tokens + FORECAST_TOKENS)
            more += max(0, blocks_for(soon, bs) - len(seq.block_table))
        return self.pool.num_ever_used + 1 + more


def paged_engine(
    model: Any,
    tokenizer: Any,
    *,
    context_length: int,
    config: EngineSettings | None = None,
    clock=time.perf_counter,
    seed: int | None = None,
    sliding_window: int | None = None,
) -> EngineCore:
    """The engine core over a PagedRunner: the engine of every model the paged seam fits."""
    cfg = config or EngineSettings()
    runner = PagedRunner(
        model, tokenizer, context_length=context_length, config=cfg, clock=clock,
        sliding_window=sliding_window,
    )  # fmt: skip
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    core = EngineCore(
        runner, config=cfg, grammars=Grammars(tokenizer, vocab), clock=clock, seed=seed
    )
    runner.attach(core)
    return core


def _tile_queries() -> int:
    """The host attention's query tile (imported only where host steps run)."""
    from batchmlx.engine.host.attention import TILE_QUERIES

    return TILE_QUERIES


def _kv_dtype(model: Any) -> mx.Dtype:
    """The dtype the model's keys come out in, found by one probe token: storing KV in exactly
    that dtype keeps paged attention bit-for-bit the attention of a contiguous cache."""
    from mlx_lm.models.cache import make_prompt_cache

    # through the first layer alone (its keys are those a whole forward writes there): the
    # whole model on MLX's CPU path took 0.12-0.17 s of every start at 135M, 0.01 s this way.
    # A model whose forward needs all its layers (masks from a later layer's cache) runs whole.
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, list) and len(layers) > 1:
        try:
            inner.layers = layers[:1]
            cache = make_prompt_cache(model)
            model(mx.array([[0]]), cache=cache)
            return cache[0].state[0].dtype
        except Exception:  # noqa: BLE001 - any failure: the whole forward below decides
            pass
        finally:
            inner.layers = layers
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    return cache[0].state[0].dtype
