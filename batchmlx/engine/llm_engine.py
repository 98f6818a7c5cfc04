"""The engine loop: schedule → run → sample → postprocess (core/postprocess.py) → update.

Continuous-batching mode and simple mode are the same loop; simple mode runs one sequence at a
time (max_batch_size 1), so both give the same tokens for the same request.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from typing import Any

import mlx.core as mx

from batchmlx.core.blocks import BlockPool
from batchmlx.core.engine_api import EngineSettings, StepError, TokenCallback, run_to_completion
from batchmlx.core.finish import FinishRules
from batchmlx.core.kv_manager import blocks_for
from batchmlx.core.postprocess import Generation, Postprocessor
from batchmlx.core.request import CacheOutcome, GenerationOutput, GenerationRequest, TokenLogprob
from batchmlx.core.scheduler import Scheduler, SchedulerConfig, SchedulerStats, SchedulerStep
from batchmlx.core.telemetry import EngineCounters
from batchmlx.core.width import StepReport, WidthController, WidthPhase, WidthPolicy
from batchmlx.engine.embed import Embedder
from batchmlx.engine.grammar import Grammars
from batchmlx.engine.host.memory import HeapTrimmer, release_free_memory
from batchmlx.engine.kv.decode import BUDGET_BYTES as DECODE_KV_BUDGET
from batchmlx.engine.kv.decode import DecodeKV
from batchmlx.engine.kv.paged import BatchLayout, PackedLayout, PagedKVStorage
from batchmlx.engine.runner import ModelRunner, model_dims
from batchmlx.engine.sampler import SampleRow, sample
from batchmlx.faults import crash_point


def available_memory_bytes(
    on_gpu: bool | None = None, device_info: dict[str, Any] | None = None
) -> int:
    """Memory the KV cache's share is taken of: the GPU's free memory on MLX's CUDA backend
    (where the KV arrays live; MLX reports it as `free_memory`), else the host's available
    memory (CPU, and Metal's unified memory). Arguments: for tests (None: asked of MLX)."""
    if on_gpu is None:
        on_gpu = mx.default_device().type == mx.DeviceType.gpu
    info = (mx.device_info() if device_info is None else device_info) if on_gpu else {}
    free = info.get("free_memory")
    if isinstance(free, int) and free > 0:
        return free
    available = _mem_available()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # macOS has no SC_AVPHYS_PAGES
        info = info or mx.device_info()
        return int(info.get("memory_size") or info.get("total_memory") or 8 << 30)


def _mem_available(path: str = "/proc/meminfo") -> int | None:
    """Linux's MemAvailable: free memory plus the page cache and buffers the kernel can drop.
    SC_AVPHYS_PAGES counts free pages only, so on a machine that just read or wrote a few GB of
    files it read as a few hundred MB (measured: 237 MB of 23 GB available)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Freed buffers MLX's CPU allocator keeps for reuse. Its default, 32 MiB, is less than a
# decode step frees (activations, gathered keys, logits: ~30 MB at width 64 for a 135M model),
# so every step took part of its buffers fresh from the OS and paid a page fault per 4 KB
# (7,500 a step, measured; 1,300 at 128 MiB, and decode steps 132 -> 125 ms).
CPU_BUFFER_CACHE = 256 << 20
# A KV pool growth makes room for this many more tokens of every running sequence at most (or
# up to its max_tokens): one growth serves a batch of 128-token answers, and a request without
# max_tokens, whose limit is the context, does not take the whole KV bound at once
FORECAST_TOKENS = 128


def size_buffer_cache(on_cpu: bool | None = None) -> int:
    """Raise MLX's buffer cache limit to CPU_BUFFER_CACHE on the CPU backend (never lower a
    limit already set higher; never above 1/16 of the available memory). Returns the limit in
    force."""
    if on_cpu is None:
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
    limit = min(CPU_BUFFER_CACHE, available_memory_bytes(on_gpu=False) // 16)
    current = mx.set_cache_limit(limit)
    if not on_cpu or current > limit:
        mx.set_cache_limit(current)
        return current
    return limit


def kv_block_budget(cfg: EngineSettings, bytes_per_block: int) -> int:
    """Blocks the KV cache may hold, block 0 (scratch) included."""
    if not cfg.memory_aware:
        return cfg.cache_max_blocks + 1
    if cfg.cache_memory_mb is not None:
        budget = cfg.cache_memory_mb << 20
    else:
        budget = int(available_memory_bytes() * cfg.cache_memory_percent)
    return max(2, budget // bytes_per_block)


@dataclass(slots=True)
class _Live:
    gen: Generation  # what the post-processing step keeps (core/postprocess.py)
    entropy: int  # stands in for the seed when the request gives none
    matcher: Any = None  # llguidance matcher of a constrained request


@dataclass(slots=True)
class EngineStats:
    """The paged engine's own measures. Step counts are the scheduler's and sampled tokens the
    post-processing step's: kept there once, read through here."""

    scheduler: SchedulerStats
    post: Postprocessor
    kv_bound_bytes: int
    peak_kv_bytes: int = 0  # largest KV storage actually allocated
    peak_decode_kv_bytes: int = 0  # largest dense copy of the decodes' KV (kv/decode.py)
    bound_violations: int = 0  # steps where allocated KV exceeded the bound (should stay 0)
    model_s: float = 0.0  # wall time in the model forward (graph built and evaluated)
    sample_s: float = 0.0  # wall time choosing tokens from the logits
    step_s: float = 0.0  # wall time of whole steps (scheduling, layout, forward, sampling)

    steps = property(attrgetter("scheduler.steps"))
    prefill_steps = property(attrgetter("scheduler.prefill_steps"))
    decode_steps = property(attrgetter("scheduler.decode_steps"))
    mixed_steps = property(attrgetter("scheduler.mixed_steps"))  # decodes and prompt chunks
    generated_tokens = property(attrgetter("post.generated_tokens"))

    def as_dict(self) -> dict[str, Any]:
        counted = ("steps", "prefill_steps", "decode_steps", "mixed_steps", "generated_tokens")
        own = [k for k in self.__slots__ if k not in ("scheduler", "post")]
        return {k: getattr(self, k) for k in (*counted, *own)}


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        context_length: int,
        config: EngineSettings | None = None,
        clock=time.perf_counter,
        seed: int | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """sliding_window: the model has layers that see only that many keys (choose.py): their
        masks are limited to it, and steps never use cascade attention (whose shared-prefix
        part has no mask)."""
        self.cfg = cfg = config or EngineSettings()
        self.sliding_window = sliding_window
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.clock = clock
        self._rand = random.Random(seed)
        size_buffer_cache()
        self.heap = HeapTrimmer()  # freed heap pages back to the OS (engine/host/memory.py)
        num_layers, n_kv, head_dim = model_dims(model)
        dtype = _kv_dtype(model)
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
        self.runner = ModelRunner(model, self.storage)
        # mixed steps need the packed layout: padded, one prompt chunk would cost every decode
        # row its length (a model without the attention seam, or with sliding-window layers,
        # whose masks the packed segments do not carry, keeps prefill-or-decode steps)
        self.mixed_steps = cfg.mixed_steps and self.runner.packs and sliding_window is None
        # the decodes' KV kept contiguous (packed steps only), in at most half the KV bound
        # and at most decode.BUDGET_BYTES
        self.decode_kv = (
            DecodeKV(self.storage, budget_bytes=min(kv_bound // 2, DECODE_KV_BUDGET))
            if self.mixed_steps and cfg.dense_decode
            else None
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batch_size=cfg.running_bound,
                block_size=cfg.block_size,
                num_blocks=num_blocks,
                max_prefill_tokens=cfg.max_prefill_tokens,
                enable_prefix_cache=cfg.use_paged_cache,
                prefix_grouping=cfg.prefix_grouping,
                mixed_steps=self.mixed_steps,
            ),
            self.pool,
        )
        self.post = Postprocessor(self)  # each sampled token's one step (core/postprocess.py)
        self.stats = EngineStats(self.scheduler.stats, self.post, kv_bound)
        # the running width of queued work, sized by measured throughput and KV memory
        self.width: WidthController | None = None
        if cfg.adaptive_width and not cfg.simple:
            self.width = WidthController(WidthPolicy(cap=cfg.running_bound))
            self.scheduler.running_limit = self.width.limit
        self._memory_preemptions = 0
        vocab = getattr(getattr(model, "args", None), "vocab_size", None)
        self.grammars = Grammars(tokenizer, vocab)  # structured outputs, compiled on first use
        self._embedder: Embedder | None = None
        self._live: dict[str, _Live] = {}
        # called with (request_id, token_id) for every token a request emits (streaming)
        self.on_token: TokenCallback | None = None

    # -- the interface the worker uses ---------------------------------------------------------
    def add(self, req: GenerationRequest) -> None:
        """Raises ValueError for a prompt that leaves no room (core/finish.py's one rule)."""
        rules = FinishRules.for_request(req, self.max_context_tokens)
        added_at, entropy = self.clock(), self._rand.getrandbits(63)
        matcher = self.grammars.matcher(req.grammar) if req.grammar else None
        grammar = None if matcher is None else partial(Grammars.advance, matcher)
        gen = Generation(req, rules, added_at, grammar)
        self._live[req.request_id] = _Live(gen, entropy, matcher)
        self.scheduler.add(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> bool:
        self._live.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def generated_so_far(self, request_id: str) -> int:
        """Tokens a running request has generated (0 once it is done or unknown)."""
        seq = self.scheduler.get(request_id)
        return 0 if seq is None else seq.num_tokens - seq.num_prompt_tokens

    def counters(self) -> EngineCounters:
        """Read once per step by the worker's metrics."""
        st, sched, pool = self.stats, self.scheduler.stats, self.pool
        return EngineCounters(
            steps=sched.steps, step_s=st.step_s, generated_tokens=self.post.generated_tokens,
            preemptions=sched.preemptions, hits=sched.hits, prefix_hits=sched.prefix_hits,
            misses=sched.misses, running=len(self.scheduler.running),
            blocks_in_use=pool.num_used, blocks_cached=pool.num_cached, blocks_free=pool.num_free,
        )  # fmt: skip

    @property
    def embedder(self) -> Embedder:
        """Mean-pooled embeddings of the same model (engine/embed.py)."""
        if self._embedder is None:
            self._embedder = Embedder(self.runner.model)
        return self._embedder

    def release_memory(self) -> int:
        """Freed memory back to the OS (MLX's buffer cache, the heap's free pages), after a
        large one-off piece of work or when idle: bytes MLX's cache held."""
        return release_free_memory()

    @property
    def pool_blocks(self) -> int:
        return self.storage.max_blocks

    @property
    def max_context_tokens(self) -> int:
        """Prompt plus generated tokens one sequence may reach: the model's context, or the KV
        pool when that is smaller."""
        return min(self.context_length, (self.pool_blocks - 1) * self.cfg.block_size)

    def step(self) -> list[GenerationOutput]:
        t0 = time.perf_counter()
        started = self.clock()  # the width controller's time (tests pass a fake clock)
        step = self.scheduler.schedule()
        if step is None:
            return []
        try:
            crash_point("engine_step")
            sampled, finished = self._run(step)
        except Exception as exc:
            raise StepError([s.seq.seq_id for s in step.seqs], exc) from exc
        done = self.scheduler.update(step, sampled, finished)
        self.stats.step_s += time.perf_counter() - t0
        self.heap.tick()
        if self.width is not None:
            self._size_width(len(sampled), self.clock() - started)
        # sequences the scheduler ended itself (the pool cannot hold them even alone)
        return [self._output(seq) for seq in [*step.finished, *done]]

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Run requests to completion (tests, benchmarks, scripts)."""
        return run_to_completion(self, requests)

    @property
    def running_limit(self) -> int:
        """The running width batch work is admitted up to now (the worker claims by it)."""
        return self.scheduler.running_limit

    # -- internals -----------------------------------------------------------------------------
    def _size_width(self, generated: int, seconds: float) -> None:
        sched = self.scheduler
        memory = sched.stats.preemptions - sched.stats.urgent_preemptions
        preempted, self._memory_preemptions = memory - self._memory_preemptions, memory
        assert self.width is not None
        queued = queued_blocks = 0
        if sched.waiting and self.width.phase is WidthPhase.GROWING:  # it may admit them all
            bs = self.cfg.block_size
            for seq in sched.waiting:
                longest = seq.num_prompt_tokens + self._live[seq.seq_id].gen.rules.max_tokens
                queued += 1
                queued_blocks += blocks_for(longest, bs)
        self.width.observe(StepReport(
            generated=generated, seconds=seconds, running=len(sched.running),
            waiting=bool(sched.waiting), blocks_used=self.pool.num_used,
            blocks_total=self.pool.num_usable, preempted=preempted, queued=queued,
            queued_blocks=queued_blocks,
        ))  # fmt: skip
        sched.running_limit = self.width.admission_limit(sched.online_running())

    def _run(self, step: SchedulerStep) -> tuple[dict[str, int], set[str]]:
        """Forward the step's tokens, sample the rows that sample, post-process each token."""
        if not step.seqs:
            return {}, set()
        rows = [i for i, s in enumerate(step.seqs) if s.samples]
        logits = self._forward(step, rows)
        if not rows:  # a prompt chunk that samples nothing
            return {}, set()
        tokens, lps = self._sample(step, rows, logits)
        now = self.clock()
        sampled: dict[str, int] = {}
        finished: set[str] = set()
        for i, tok, lp in zip(rows, tokens, lps, strict=True):
            seq_id = step.seqs[i].seq.seq_id
            sampled[seq_id] = tok
            if self.post(self._live[seq_id].gen, tok, lp, now) is not None:
                finished.add(seq_id)
        return sampled, finished

    def _forward(self, step: SchedulerStep, rows: list[int]) -> mx.array:
        """The logits of `rows` (indices into step.seqs), evaluated with the KV they wrote."""
        st = self.stats
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
        layout = (PackedLayout if self.mixed_steps else BatchLayout).build(
            block_size=self.cfg.block_size,
            n_kv_heads=self.storage.n_kv_heads,
            token_chunks=chunks,
            starts=starts,
            block_tables=tables,
            share_prefix=self.sliding_window is None,
        )
        dense = self.decode_kv
        if dense is not None:
            dense.attach(layout, [s.seq.seq_id for s in step.seqs], chunks, starts, tables)
        t0 = time.perf_counter()
        try:
            logits = self.runner.forward(layout, rows)
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

    def _kv_forecast(self) -> int:
        """Block ids the running sequences may need soon: those handed out so far and each
        one's blocks still to come in its next FORECAST_TOKENS tokens at most, or up to its
        max_tokens (an upper bound: some stop early, and freed blocks are reused first)."""
        bs = self.cfg.block_size
        more = 0
        for seq in self.scheduler.running:
            longest = seq.num_prompt_tokens + self._live[seq.seq_id].gen.rules.max_tokens
            soon = min(longest, seq.num_tokens + FORECAST_TOKENS)
            more += max(0, blocks_for(soon, bs) - len(seq.block_table))
        return self.pool.num_ever_used + 1 + more

    def _sample(
        self, step: SchedulerStep, rows: list[int], logits: mx.array
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per sampling row, each grammar's mask applied first."""
        sample_rows, constrained = [], []
        for j, i in enumerate(rows):
            seq = step.seqs[i].seq
            live = self._live[seq.seq_id]
            sample_rows.append(SampleRow(live.gen.request.params, seq.num_generated, live.entropy))
            if live.matcher is not None:
                constrained.append((live.matcher, j))
        t0 = time.perf_counter()
        logits = self.grammars.mask(logits, constrained)
        tokens, lps = sample(logits, sample_rows)
        self.stats.sample_s += time.perf_counter() - t0
        return tokens, lps

    def _output(self, seq) -> GenerationOutput:
        return self._live.pop(seq.seq_id).gen.output(
            cached_tokens=seq.num_cached_tokens,
            cache_outcome=seq.cache_outcome or CacheOutcome.MISS,
            preemptions=seq.num_preemptions,
        )


def _kv_dtype(model: Any) -> mx.Dtype:
    """The dtype the model's keys come out in, found by one probe token: storing KV in exactly
    that dtype keeps paged attention bit-for-bit the attention of a contiguous cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    keys = cache[0].state[0]
    return keys.dtype
