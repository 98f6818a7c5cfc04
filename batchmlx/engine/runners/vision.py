"""Vision-language models through mlx-vlm's model classes, as a Runner.

Its scheduling policy alternates two kinds of step: a prefill of at most one waiting prompt (its
own cache, the prefix-cache hit and the vision tower: one at a time), then a decode of every
running request in one batched forward over mlx-vlm's left-padded BatchKVCache (continuous: a
request joins after its prefill and leaves when it ends). What it shares with the paged runner:
the block pool and KV manager of core (prefix-cache lookup, registration, release, eviction by
LRU); with every runner, the engine core's sampling and post-processing (engine/core.py). The
KV of each registered block is kept here by block id; a hit is the concatenation of its blocks'
KV. The vision tower runs only for an image neither wholly in the hit blocks nor among the last
images whose features it kept (by content digest). Prompts come from engine/vision/prompter.py.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from batchmlx.core.blocks import BlockPool
from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.kv_manager import KVCacheManager
from batchmlx.core.request import CacheOutcome, GenerationRequest
from batchmlx.core.sequence import Sequence
from batchmlx.core.telemetry import EngineCounters
from batchmlx.core.width import initial_width
from batchmlx.engine.core import Ended, EngineCore, Live, Ran
from batchmlx.engine.vision.prompter import VisionInputs

log = logging.getLogger("batchmlx.engine")

# images whose vision-tower features the runner keeps (by content digest), so the same image
# under another question skips the tower even where its last block is not a cache hit
FEATURE_CACHE_IMAGES = 16


class Phase(enum.Enum):
    PREFILL = "prefill"  # one waiting prompt: its first token
    DECODE = "decode"  # every running request: its next token


@dataclass(slots=True)
class _Slot:
    seq: Sequence
    cached_tokens: int = 0
    outcome: CacheOutcome = CacheOutcome.MISS
    running: bool = False  # a row of the decode batch (its last token not yet computed)
    rope_delta: int = 0  # M-RoPE: a token's position is its index plus this (after the media)
    caches: Any = None  # its prompt's caches, between its prefill and joining the batch


class VisionRunner:
    """The Runner (engine/core.py) over an mlx-vlm model. batched=False, or a model whose caches
    are not plain KV caches: one request at a time. The log says which."""

    samples_itself = False

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        context_length: int,
        config: EngineSettings,
        batched: bool = True,
    ) -> None:
        from mlx_vlm.models.cache import KVCache, make_prompt_cache

        self.cfg = config
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.context_length = context_length
        self.pool = BlockPool(self.cfg.cache_max_blocks, self.cfg.block_size)
        self.kv = KVCacheManager(self.pool, enable_prefix_cache=self.cfg.use_paged_cache)
        self._blocks: dict[int, list[tuple[Any, Any]]] = {}  # block id → per-layer (keys, values)
        self._waiting: list[tuple[int, int, str]] = []  # (priority, order, request id)
        self._queued: dict[str, Live] = {}
        self._order = itertools.count()
        self._running: list[Live] = []  # the decode batch's rows, in row order
        self._batch: list[Any] | None = None  # its per-layer BatchKVCache
        self._last = Phase.DECODE  # a prefill may come first
        self._admitted: Live | None = None  # the prompt of a prefill step in progress
        self._ending: list[Ended] = []  # ended in a commit under way
        # first admissions by cache outcome
        self.outcomes = dict.fromkeys(CacheOutcome, 0)
        self.vision_runs = 0  # prompts whose images went through the vision tower
        # an image's merged features by digest, most recent last (FEATURE_CACHE_IMAGES of them)
        self._features: OrderedDict[bytes, Any] = OrderedDict()
        plain = all(type(c) is KVCache for c in make_prompt_cache(model.language_model))
        # M-RoPE (Qwen2-VL): positions are 3-D (time, height, width) over media tokens; mlx-vlm
        # keeps them on the language model between calls, for one sequence, so the runner
        # computes each request's itself and passes them on every forward
        self.mrope = hasattr(model.language_model, "get_rope_index")
        self.width = self.cfg.running_bound if batched and plain else 1
        if self.width > 1:
            log.info("vision engine: prompts prefilled one at a time, decodes batched (up to "
                     "%d)", self.width)  # fmt: skip
        else:
            log.info("vision engine: one request at a time (%s)", "asked" if not batched else
                     "this model's caches are not plain KV caches mlx-vlm can batch")  # fmt: skip

    # -- Runner --------------------------------------------------------------------------------
    @property
    def max_context_tokens(self) -> int:
        return self.context_length

    @property
    def running_limit(self) -> int:
        return min(self.width, initial_width(self.cfg))

    def admit(self, live: Live) -> None:
        req = live.gen.request
        live.slot = _Slot(Sequence(req, next(self._order)))
        self._queued[req.request_id] = live
        heapq.heappush(self._waiting, (req.priority, live.slot.seq.arrival, req.request_id))

    def drop(self, live: Live) -> None:
        self._queued.pop(live.request_id, None)
        if live.slot.running:
            self._leave([live])

    def execute(self) -> Ran | None:
        """A prefill after a decode step (or none running), else a decode of the batch."""
        if (self._last is Phase.DECODE or not self._running) and len(self._running) < self.width:
            self._admitted = live = self._next()
            if live is not None:
                self._last = Phase.PREFILL
                live.slot.caches, logits = self._prefill(live)
                return Ran([live], logits, state=Phase.PREFILL)
        self._last = Phase.DECODE
        if not self._running:
            return None
        return Ran(list(self._running), self._decode(), state=Phase.DECODE)

    def commit(self, ran: Ran, sampled: list[int], finished: set[str]) -> list[Ended]:
        """Each sampled token's end (the context bounds max tokens in FinishRules, so the room
        is never passed; a full pool ends a request as LENGTH); the prefilled prompt joins the
        decode batch."""
        self._ending = ended = []  # fail() names them too, should a later row's work raise
        for live, token in zip(ran.lives, sampled, strict=True):
            slot = live.slot
            if live.request_id in finished or not self.kv.reserve(slot.seq, 1):
                ended.append(Ended(live))
                self._finish(live, ended[-1])
                continue
            slot.seq.token_ids.append(token)  # computed by the next decode
            if ran.state is Phase.PREFILL:
                self._join(live, slot.caches)
            slot.caches = None
        self._admitted, self._ending = None, []
        return ended

    def fail(self) -> tuple[list[str], bool]:
        failed = [*self._running, *([self._admitted] if self._admitted is not None else [])]
        ids = list(dict.fromkeys([e.live.request_id for e in self._ending]
                                 + [live.request_id for live in failed]))  # fmt: skip
        self._ending = []
        for live in failed:
            self._release(live)
        self._running, self._batch, self._admitted = [], None, None  # caches in unknown state
        return ids, True

    def counters(self, steps: int, step_s: float, generated: int) -> EngineCounters:
        o = self.outcomes
        return EngineCounters(
            steps=steps, step_s=step_s, generated_tokens=generated,
            hits=o[CacheOutcome.HIT], prefix_hits=o[CacheOutcome.PREFIX_HIT],
            misses=o[CacheOutcome.MISS], running=len(self._running),
            blocks_in_use=self.pool.num_used, blocks_cached=self.pool.num_cached,
            blocks_free=self.pool.num_free,
        )  # fmt: skip

    @property
    def embedder(self) -> Any:
        raise ValueError("embeddings are not computed for vision-language models")

    # -- internals -----------------------------------------------------------------------------
    def _next(self) -> Live | None:
        while self._waiting:
            _, _, rid = heapq.heappop(self._waiting)
            live = self._queued.pop(rid, None)
            if live is not None:
                return live
        return None

    def _prefill(self, live: Live) -> tuple[list[Any], Any]:
        """The prompt's KV (the cached blocks, then the rest computed) and its last logits."""
        from mlx_vlm.models.cache import make_prompt_cache

        slot, bs = live.slot, self.cfg.block_size
        seq = slot.seq
        hits = self.kv.cached_prefix(seq)
        if not self.kv.admit(seq, hits, seq.num_tokens - len(hits) * bs):
            raise MemoryError(f"the KV cache ({self.pool.num_usable} blocks) cannot hold "
                              f"{seq.num_tokens} prompt tokens")  # fmt: skip
        lm = self.model.language_model
        cache = make_prompt_cache(lm)
        cached = len(hits) * bs
        if hits:
            for layer, c in enumerate(cache):
                keys = mx.concatenate([self._blocks[b.block_id][layer][0] for b in hits], axis=2)
                values = mx.concatenate([self._blocks[b.block_id][layer][1] for b in hits], axis=2)
                c.update_and_fetch(keys, values)
        ids = mx.array([seq.token_ids])
        embeds = self._embeddings(ids, seq.request, cached)
        extra = {}
        if self.mrope:
            positions, slot.rope_delta = self._positions(ids, seq.request.media)
            extra["position_ids"] = positions[:, :, cached:]
        out = lm(ids[:, cached:], inputs_embeds=embeds, cache=cache, **extra)
        slot.cached_tokens = cached
        max_hit = self.kv.max_cached_blocks(seq, bs)
        if cached == 0:
            slot.outcome = CacheOutcome.MISS
        elif len(hits) == max_hit:
            slot.outcome = CacheOutcome.HIT
        else:
            slot.outcome = CacheOutcome.PREFIX_HIT
        self.outcomes[slot.outcome] += 1
        seq.num_computed_tokens = seq.num_tokens
        self._register(live, cache, 0, 0)
        return cache, _logits(out)[:, -1, :]

    def _positions(self, ids: Any, inputs: VisionInputs | None) -> tuple[Any, int]:
        """The prompt's M-RoPE positions (3, 1, tokens), by the model's own rule over its
        image and video grids, and the delta a later token's position adds to its index."""
        extra = {} if inputs is None else inputs.extra
        positions, delta = self.model.language_model.get_rope_index(
            ids, extra.get("image_grid_thw"), extra.get("video_grid_thw"))  # fmt: skip
        if positions.ndim == 2:  # text only: the three axes are the token's index
            positions = mx.broadcast_to(positions[None], (3, *positions.shape))
        return positions, int(mx.array(delta).reshape(-1)[0].item())

    def _embeddings(self, ids: Any, req: GenerationRequest, cached: int) -> Any:
        """The input embeddings of the prompt from position `cached` on. The vision tower runs
        only for an image whose features are neither in the hit blocks nor in the feature
        cache (the merged features of the last `FEATURE_CACHE_IMAGES` images, by digest)."""
        lm = self.model.language_model
        spans = [s for s in req.media_spans if s.end > cached]  # not wholly in the hit blocks
        inputs: VisionInputs | None = req.media
        if inputs is None or all(s.digest in self._features for s in spans):
            embeds = lm.model.embed_tokens(ids[:, cached:])
            for span in spans:  # features the tower computed for an earlier prompt
                self._features.move_to_end(span.digest)
                lo = max(span.start, cached)
                feats = self._features[span.digest][lo - span.start :]
                embeds[0, lo - cached : span.end - cached] = feats.astype(embeds.dtype)
            return embeds
        self.vision_runs += 1
        full = self.model.get_input_embeddings(ids, inputs.pixel_values, **inputs.extra)
        merged = full.inputs_embeds
        for span in req.media_spans:
            self._features[span.digest] = mx.contiguous(merged[0, span.start : span.end])
            self._features.move_to_end(span.digest)
        while len(self._features) > FEATURE_CACHE_IMAGES:
            self._features.popitem(last=False)
        return merged[:, cached:]

    def _join(self, live: Live, caches: list[Any]) -> None:
        from mlx_vlm.models.cache import BatchKVCache

        rows = [BatchKVCache.merge([c]) for c in caches]
        if self._batch is None:
            self._batch = rows
        else:
            for batch, row in zip(self._batch, rows, strict=True):
                batch.extend(row)
        self._running.append(live)
        live.slot.running = True

    def _decode(self) -> Any:
        """One batched forward of every running request's last token: its next-token logits."""
        running, batch = self._running, self._batch
        assert batch is not None
        tokens = mx.array([[live.slot.seq.token_ids[-1]] for live in running])
        extra = {}
        if self.mrope:  # each row's own position: its last token's index plus its delta
            at = mx.array([[lv.slot.seq.num_tokens - 1 + lv.slot.rope_delta] for lv in running])
            extra["position_ids"] = mx.broadcast_to(at[None], (3, *at.shape))
        logits = _logits(self.model.language_model(tokens, cache=batch, **extra))[:, -1, :]
        pads = batch[0].left_padding.tolist()
        for i, live in enumerate(running):
            live.slot.seq.num_computed_tokens = live.slot.seq.num_tokens
            self._register(live, batch, i, int(pads[i]))
        return logits

    def _leave(self, gone: list[Live]) -> None:
        """Take rows out of the decode batch (ended or aborted)."""
        keep = [i for i, live in enumerate(self._running) if live not in gone]
        for live in gone:
            live.slot.running = False
            self._release(live)
        if not keep:
            self._running, self._batch = [], None
        elif len(keep) < len(self._running):
            assert self._batch is not None
            index = mx.array(keep)
            for c in self._batch:
                c.filter(index)
            self._running = [self._running[i] for i in keep]

    def _register(self, live: Live, caches: list[Any], row: int, pad: int) -> None:
        """Offer the newly full blocks to the prefix cache, keeping their KV by block id (row
        `row` of `caches`, its tokens from buffer index `pad` on)."""
        seq, bs = live.slot.seq, self.cfg.block_size
        before = seq.num_registered_blocks
        self.kv.register_full_blocks(seq)
        if seq.num_registered_blocks == before:
            return
        kept = []
        for i in range(before, seq.num_registered_blocks):
            lo, hi = pad + i * bs, pad + (i + 1) * bs
            layers = [(c.keys[row : row + 1, :, lo:hi, :], c.values[row : row + 1, :, lo:hi, :])
                      for c in caches]  # fmt: skip
            self._blocks[seq.block_table[i]] = layers
            kept.extend(a for kv in layers for a in kv)
        mx.eval(*kept)  # copies: the slices keep no hold on the whole cache

    def _finish(self, live: Live, ended: Ended) -> None:
        slot = live.slot
        ended.extras.update(cached_tokens=slot.cached_tokens, cache_outcome=slot.outcome)
        if slot.running:
            self._leave([live])
        else:
            self._release(live)

    def _release(self, live: Live) -> None:
        seq = live.slot.seq
        table = seq.block_table
        if table:
            self.kv.free(seq)
            for block_id in table:  # KV is kept only while its block holds a cached prefix
                if self.pool.blocks[block_id].block_hash is None:
                    self._blocks.pop(block_id, None)


def _logits(out: Any) -> Any:
    return getattr(out, "logits", out)


def vision_engine(
    model: Any,
    processor: Any,
    *,
    context_length: int,
    config: EngineSettings | None = None,
    clock=time.perf_counter,
    seed: int | None = None,
    batched: bool = True,
) -> EngineCore:
    """The engine core over a VisionRunner (no structured outputs: the translator refuses
    them on vision-language models)."""
    cfg = config or EngineSettings()
    runner = VisionRunner(
        model, processor, context_length=context_length, config=cfg, batched=batched
    )
    return EngineCore(runner, config=cfg, grammars=None, clock=clock, seed=seed)
