"""Vision-language models through mlx-vlm (the `vision` extra): prompts with images and videos,
and an engine.

`VisionPrompter` turns chat messages and their images and videos into what the engine runs: the
model's chat template (an entry per part), the processor's pixels and its expanded placeholder
tokens, and one `MediaSpan` per part (its placeholder run keyed by the part's digest, for the
prefix cache: core/media.py). A video's frames come from engine/video.py.

`VisionEngine` is EngineProtocol over mlx-vlm's model classes: a step prefills at most one
waiting prompt (its own cache; one at a time, as the vision tower and the prefix-cache hit are
per prompt), then decodes every running request in one batched forward over mlx-vlm's
left-padded BatchKVCache (continuous: a request joins after its prefill and leaves when it
ends). What it shares with the paged engine: the block pool and KV manager of core
(prefix-cache lookup, registration, release, eviction by LRU), each sampled token's
post-processing step (core/postprocess.py) and the sampler (engine/sampler.py). The KV of each
registered block is kept here by block id; a hit is the concatenation of its blocks' KV. The
vision tower runs only for an image neither wholly in the hit blocks nor among the last images
whose features it kept (by content digest).
"""

from __future__ import annotations

import heapq
import io
import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from batchmlx.core.blocks import BlockPool
from batchmlx.core.engine_api import EngineSettings, StepError, TokenCallback, run_to_completion
from batchmlx.core.finish import FinishRules
from batchmlx.core.kv_manager import KVCacheManager
from batchmlx.core.media import MediaSpan
from batchmlx.core.postprocess import Generation, Postprocessor
from batchmlx.core.request import CacheOutcome, GenerationOutput, GenerationRequest
from batchmlx.core.sequence import Sequence
from batchmlx.core.telemetry import EngineCounters
from batchmlx.core.width import initial_width
from batchmlx.engine.sampler import SampleRow, sample
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.media import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_FRAMES, MediaKind, MediaPart

log = logging.getLogger("batchmlx.engine")


@dataclass(frozen=True, slots=True)
class VisionInputs:
    """What the engine feeds the vision tower of one prompt (GenerationRequest.media)."""

    pixel_values: Any  # mx.array, as the processor made it
    extra: dict[str, Any] = field(default_factory=dict)  # other processor outputs (image sizes)


class PromptRefused(ValueError):
    """A prompt the model cannot take (a video on an image-only model, more images than it
    takes, a video PyAV cannot decode): the line's 400, `param` the part, `code` its code."""

    def __init__(
        self, message: str, param: str | None = None, code: ErrorCode = ErrorCode.INVALID_VALUE
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# images one prompt may hold, by model_type, where mlx-vlm's model takes fewer than the request
# bound (formats.media.MAX_MEDIA_PARTS): its LLaVA merges the features of one image per input
MAX_IMAGES = {"llava": 1}
# model_types whose mlx-vlm model and processor take video (`videos=`, pixel_values_videos and
# video_grid_thw, M-RoPE positions); other families' videos are the line's 400
VIDEO_MODELS = frozenset({"qwen2_vl", "qwen2_5_vl"})
# images whose vision-tower features the engine keeps (by content digest), so the same image
# under another question skips the tower even where its last block is not a cache hit
FEATURE_CACHE_IMAGES = 16


class VisionPrompter:
    """Messages and resolved media parts → (prompt tokens, spans, inputs), through the model's
    own processor (mlx-vlm loads it with the model). Videos are decoded into frames here
    (engine/video.py) and go to the processor as `videos=`, on the families that take them."""

    def __init__(self, processor: Any, config: dict[str, Any], model_name: str) -> None:
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.model_name = model_name
        self.model_type = str(config.get("model_type"))
        self.image_token_id = int(config.get("image_token_index", config.get("image_token_id", -1)))
        self.video_token_id = int(config.get("video_token_index", config.get("video_token_id", -1)))
        self.max_images = MAX_IMAGES.get(self.model_type)
        has_videos = getattr(processor, "video_processor", None) is not None
        self.takes_video = self.model_type in VIDEO_MODELS and has_videos

    def prompt(
        self, messages: Seq[dict[str, str]], media: Seq[MediaPart]
    ) -> tuple[list[int], str, tuple[MediaSpan, ...], VisionInputs | None]:
        self._check(media)
        chat = []
        for i, m in enumerate(messages):  # each part where it sat, then the message's text
            content: list[dict[str, str]] = [{"type": p.kind.value} for p in media
                                             if p.message == i]  # fmt: skip
            content.append({"type": "text", "text": m["content"]})
            chat.append({"role": m["role"], "content": content})
        text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                  tokenize=False)  # fmt: skip
        if not media:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return list(ids), text, (), None
        images = [_image(p) for p in media if p.kind is MediaKind.IMAGE]
        videos = [_frames(p) for p in media if p.kind is MediaKind.VIDEO]
        try:
            out = self.processor(text=[text], **({"images": images} if images else {}),
                                 **({"videos": videos} if videos else {}))  # fmt: skip
        except ValueError as exc:  # frames smaller than a patch, an aspect it refuses
            where = media[0].param if len(media) == 1 else None
            what = where or "these images or videos"
            raise PromptRefused(
                f"the model's processor cannot take {what} ({exc}).", where
            ) from None
        ids = [int(t) for t in mx.array(out["input_ids"]).reshape(-1).tolist()]
        spans = _spans(ids, {MediaKind.IMAGE: self.image_token_id,
                             MediaKind.VIDEO: self.video_token_id}, media)  # fmt: skip
        pixels = "pixel_values" if images else "pixel_values_videos"
        extra = {k: mx.array(v) for k, v in out.items() if k not in (
                 "input_ids", "attention_mask", "pixel_values", "pixel_values_videos")}  # fmt: skip
        return ids, text, spans, VisionInputs(mx.array(out[pixels]), extra)

    def _check(self, media: Seq[MediaPart]) -> None:
        """The parts this model cannot take: the line's 400 naming the part."""
        images = 0
        for part in media:
            if part.kind is MediaKind.VIDEO and not self.takes_video:
                raise PromptRefused(
                    f"the model '{self.model_name}' ({self.model_type}) takes no video; "
                    f"{part.param} is a video. Video runs on Qwen2-VL and Qwen2.5-VL models.",
                    part.param, ErrorCode.UNSUPPORTED_VALUE,
                )  # fmt: skip
            if part.kind is MediaKind.IMAGE:
                images += 1
                if self.max_images is not None and images > self.max_images:
                    raise PromptRefused(
                        f"the model '{self.model_name}' takes at most {self.max_images} "
                        f"image(s) per request; {part.param} is one more.", part.param,
                    )  # fmt: skip
        kinds = {p.kind for p in media}
        if len(kinds) > 1:  # mlx-vlm's Qwen2-VL runs its vision tower over one kind per prompt
            second = next(p for p in media if p.kind is not media[0].kind)
            raise PromptRefused(
                f"the model '{self.model_name}' takes images or videos in one request, not "
                f"both; {second.param} is a {second.kind.value} after a "
                f"{media[0].kind.value}.", second.param, ErrorCode.UNSUPPORTED_VALUE,
            )  # fmt: skip


def _image(part: MediaPart) -> Any:
    from PIL import Image

    try:
        return Image.open(io.BytesIO(part.data or b"")).convert("RGB")
    except Exception as exc:  # PIL raises several kinds for bytes that are no image
        raise PromptRefused(f"{part.param} is not an image PIL can read ({exc}).",
                            part.param) from None  # fmt: skip


def _frames(part: MediaPart) -> Any:
    """A video's sampled frames as one (frames, height, width, 3) array, the processor's input."""
    import numpy as np

    from batchmlx.engine.video import VideoUnreadable, decode_video

    try:
        clip = decode_video(part.data or b"", part.fps or DEFAULT_VIDEO_FPS,
                            part.max_frames or DEFAULT_VIDEO_FRAMES)  # fmt: skip
        return np.stack(clip.frames)
    except VideoUnreadable as exc:
        raise PromptRefused(f"{part.param} is not a video PyAV can decode ({exc}).",
                            part.param) from None  # fmt: skip
    except ValueError as exc:  # frames of different sizes in one clip
        raise PromptRefused(f"{part.param}: its frames cannot be read as one clip ({exc}).",
                            part.param) from None  # fmt: skip


def _spans(
    ids: list[int], tokens: dict[MediaKind, int], media: Seq[MediaPart]
) -> tuple[MediaSpan, ...]:
    """The runs of placeholder tokens, one per image or video, in order."""
    kind_of = {t: k for k, t in tokens.items() if t >= 0}
    runs: list[tuple[int, int, MediaKind]] = []
    for i, t in enumerate(ids):
        kind = kind_of.get(t)
        if kind is None:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i and runs[-1][2] is kind:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, kind)
        else:
            runs.append((i, 1, kind))
    kinds = [r[2] for r in runs]
    if kinds != [p.kind for p in media]:
        raise PromptRefused(
            f"the prompt holds {len(runs)} placeholder runs for {len(media)} images and videos; "
            "this model's template takes one per placeholder."
        )
    return tuple(MediaSpan(s, n, p.digest or b"") for (s, n, _), p in zip(runs, media, strict=True))


@dataclass(slots=True)
class _Live:
    gen: Generation
    seq: Sequence
    entropy: int
    cached_tokens: int = 0
    outcome: CacheOutcome = CacheOutcome.MISS
    running: bool = False  # a row of the decode batch (its last token not yet computed)
    rope_delta: int = 0  # M-RoPE: a token's position is its index plus this (after the media)


class VisionEngine:
    """EngineProtocol and EngineTelemetry over an mlx-vlm model.

    A step prefills at most one waiting request (its own cache, the prefix-cache hit and the
    vision tower: one at a time), then decodes every running request in one batched forward
    (mlx-vlm's left-padded BatchKVCache; a request joins it after its prefill and leaves it when
    it ends). batched=False, or a model whose caches are not plain KV caches: one request at a
    time. The log says which."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        context_length: int,
        config: EngineSettings | None = None,
        clock=time.perf_counter,
        seed: int | None = None,
        batched: bool = True,
    ) -> None:
        from mlx_vlm.models.cache import KVCache, make_prompt_cache

        self.cfg = config or EngineSettings()
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.context_length = context_length
        self.clock = clock
        self._rand = random.Random(seed)
        self.pool = BlockPool(self.cfg.cache_max_blocks, self.cfg.block_size)
        self.kv = KVCacheManager(self.pool, enable_prefix_cache=self.cfg.use_paged_cache)
        self._blocks: dict[int, list[tuple[Any, Any]]] = {}  # block id → per-layer (keys, values)
        self._live: dict[str, _Live] = {}
        self._waiting: list[tuple[int, int, str]] = []  # (priority, order, request id)
        self._order = itertools.count()
        self._running: list[_Live] = []  # the decode batch's rows, in row order
        self._batch: list[Any] | None = None  # its per-layer BatchKVCache
        self.post = Postprocessor(self)
        self.on_token: TokenCallback | None = None
        # cumulative: steps, step seconds, first admissions by cache outcome
        self.steps, self.step_s = 0, 0.0
        self.outcomes = dict.fromkeys(CacheOutcome, 0)
        self.vision_runs = 0  # prompts whose images went through the vision tower
        # an image's merged features by digest, most recent last (FEATURE_CACHE_IMAGES of them)
        self._features: OrderedDict[bytes, Any] = OrderedDict()
        plain = all(type(c) is KVCache for c in make_prompt_cache(model.language_model))
        # M-RoPE (Qwen2-VL): positions are 3-D (time, height, width) over media tokens; mlx-vlm
        # keeps them on the language model between calls, for one sequence, so the engine
        # computes each request's itself and passes them on every forward
        self.mrope = hasattr(model.language_model, "get_rope_index")
        self.width = self.cfg.running_bound if batched and plain else 1
        if self.width > 1:
            log.info("vision engine: prompts prefilled one at a time, decodes batched (up to "
                     "%d)", self.width)  # fmt: skip
        else:
            log.info("vision engine: one request at a time (%s)", "asked" if not batched else
                     "this model's caches are not plain KV caches mlx-vlm can batch")  # fmt: skip

    # -- EngineProtocol ------------------------------------------------------------------------
    @property
    def max_context_tokens(self) -> int:
        return self.context_length

    @property
    def running_limit(self) -> int:
        return min(self.width, initial_width(self.cfg))

    def add(self, req: GenerationRequest) -> None:
        rules = FinishRules.for_request(req, self.max_context_tokens)
        gen = Generation(req, rules, self.clock())
        live = _Live(gen, Sequence(req, next(self._order)), self._rand.getrandbits(63))
        self._live[req.request_id] = live
        heapq.heappush(self._waiting, (req.priority, live.seq.arrival, req.request_id))

    def abort(self, request_id: str) -> bool:
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        if live.running:
            self._leave([live])
        return True

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def generated_so_far(self, request_id: str) -> int:
        live = self._live.get(request_id)
        return 0 if live is None else len(live.gen.tokens)

    def step(self) -> list[GenerationOutput]:
        t0 = time.perf_counter()
        done: list[GenerationOutput] = []
        admitted: _Live | None = None
        try:
            if len(self._running) < self.width:
                admitted = self._next()
                if admitted is not None:
                    caches, logits = self._prefill(admitted)
                    out = self._take(admitted, logits)
                    if out is not None:
                        done.append(out)
                    else:
                        self._join(admitted, caches)
            if self._running:
                done.extend(self._decode())
        except Exception as exc:
            failed = [*self._running, *([admitted] if admitted is not None else [])]
            ids = list(dict.fromkeys(live.seq.seq_id for live in failed))
            for live in failed:
                self._live.pop(live.seq.seq_id, None)
                self._release(live)
            self._running, self._batch = [], None  # its caches are in an unknown state
            raise StepError(ids, exc) from exc
        if admitted is not None or done or self._running:
            self.steps += 1
            self.step_s += time.perf_counter() - t0
        return done

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Run requests to completion (tests, benchmarks, scripts)."""
        return run_to_completion(self, requests)

    def counters(self) -> EngineCounters:
        o = self.outcomes
        return EngineCounters(
            steps=self.steps, step_s=self.step_s, generated_tokens=self.post.generated_tokens,
            hits=o[CacheOutcome.HIT], prefix_hits=o[CacheOutcome.PREFIX_HIT],
            misses=o[CacheOutcome.MISS], running=len(self._running),
            blocks_in_use=self.pool.num_used, blocks_cached=self.pool.num_cached,
            blocks_free=self.pool.num_free,
        )  # fmt: skip

    @property
    def embedder(self) -> Any:
        raise ValueError("embeddings are not computed for vision-language models")

    def release_memory(self) -> int:
        """As the paged engine's: freed memory back to the OS."""
        from batchmlx.engine.host.memory import release_free_memory

        return release_free_memory()

    # -- internals -----------------------------------------------------------------------------
    def _next(self) -> _Live | None:
        while self._waiting:
            _, _, rid = heapq.heappop(self._waiting)
            live = self._live.get(rid)
            if live is not None:
                return live
        return None

    def _prefill(self, live: _Live) -> tuple[list[Any], Any]:
        """The prompt's KV (the cached blocks, then the rest computed) and its last logits."""
        from mlx_vlm.models.cache import make_prompt_cache

        seq, bs = live.seq, self.cfg.block_size
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
            positions, live.rope_delta = self._positions(ids, seq.request.media)
            extra["position_ids"] = positions[:, :, cached:]
        out = lm(ids[:, cached:], inputs_embeds=embeds, cache=cache, **extra)
        live.cached_tokens = cached
        max_hit = self.kv.max_cached_blocks(seq, bs)
        if cached == 0:
            live.outcome = CacheOutcome.MISS
        elif len(hits) == max_hit:
            live.outcome = CacheOutcome.HIT
        else:
            live.outcome = CacheOutcome.PREFIX_HIT
        self.outcomes[live.outcome] += 1
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

    def _take(self, live: _Live, logits: Any) -> GenerationOutput | None:
        """The admitted request's first token; its output if that ended it."""
        p = live.gen.request.params
        (tok,), (lp,) = sample(logits, [SampleRow(p, len(live.gen.tokens), live.entropy)])
        return self._after(live, tok, lp)

    def _after(self, live: _Live, token: int, lp: Any) -> GenerationOutput | None:
        """One sampled token through the post-processing step; the output once it ends (the
        context bounds max tokens in FinishRules, so the room is never passed)."""
        if self.post(live.gen, token, lp, self.clock()) is not None:
            return self._finish(live)
        if not self.kv.reserve(live.seq, 1):  # the pool is full: ended as LENGTH
            return self._finish(live)
        live.seq.token_ids.append(token)  # computed by the next decode
        return None

    def _join(self, live: _Live, caches: list[Any]) -> None:
        from mlx_vlm.models.cache import BatchKVCache

        rows = [BatchKVCache.merge([c]) for c in caches]
        if self._batch is None:
            self._batch = rows
        else:
            for batch, row in zip(self._batch, rows, strict=True):
                batch.extend(row)
        self._running.append(live)
        live.running = True

    def _decode(self) -> list[GenerationOutput]:
        """One batched forward of every running request's last token, then its next token."""
        running, batch = self._running, self._batch
        assert batch is not None
        tokens = mx.array([[live.seq.token_ids[-1]] for live in running])
        extra = {}
        if self.mrope:  # each row's own position: its last token's index plus its delta
            at = mx.array([[lv.seq.num_tokens - 1 + lv.rope_delta] for lv in running])
            extra["position_ids"] = mx.broadcast_to(at[None], (3, *at.shape))
        logits = _logits(self.model.language_model(tokens, cache=batch, **extra))[:, -1, :]
        pads = batch[0].left_padding.tolist()
        for i, live in enumerate(running):
            live.seq.num_computed_tokens = live.seq.num_tokens
            self._register(live, batch, i, int(pads[i]))
        rows = [SampleRow(lv.gen.request.params, len(lv.gen.tokens), lv.entropy) for lv in running]
        toks, lps = sample(logits, rows)
        done = []
        for live, tok, lp in zip(running, toks, lps, strict=True):
            out = self._after(live, tok, lp)
            if out is not None:
                done.append(out)
        return done

    def _leave(self, gone: list[_Live]) -> None:
        """Take rows out of the decode batch (ended or aborted)."""
        keep = [i for i, live in enumerate(self._running) if live not in gone]
        for live in gone:
            live.running = False
            self._release(live)
        if not keep:
            self._running, self._batch = [], None
        elif len(keep) < len(self._running):
            assert self._batch is not None
            index = mx.array(keep)
            for c in self._batch:
                c.filter(index)
            self._running = [self._running[i] for i in keep]

    def _register(self, live: _Live, caches: list[Any], row: int, pad: int) -> None:
        """Offer the newly full blocks to the prefix cache, keeping their KV by block id (row
        `row` of `caches`, its tokens from buffer index `pad` on)."""
        seq, bs = live.seq, self.cfg.block_size
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

    def _finish(self, live: _Live) -> GenerationOutput:
        out = live.gen.output(cached_tokens=live.cached_tokens, cache_outcome=live.outcome)
        self._live.pop(live.seq.seq_id, None)
        if live.running:
            self._leave([live])
        else:
            self._release(live)
        return out

    def _release(self, live: _Live) -> None:
        table = live.seq.block_table
        if table:
            self.kv.free(live.seq)
            for block_id in table:  # KV is kept only while its block holds a cached prefix
                if self.pool.blocks[block_id].block_hash is None:
                    self._blocks.pop(block_id, None)


def _logits(out: Any) -> Any:
    return getattr(out, "logits", out)


def is_vision_model(kind: str, source: str) -> bool:
    """Whether a resolved model (core.models.ModelSpec's kind and source) is a vision-language
    one: its config.json has a `vision_config`. A hub id's config is read from the local hub
    cache, or fetched; one that cannot be read counts as text (the text loader says why)."""
    import json
    from pathlib import Path

    if kind == "mlx_dir":
        config = Path(source) / "config.json"
    elif kind == "hub":
        try:
            from huggingface_hub import hf_hub_download

            config = Path(hf_hub_download(source, "config.json"))
        except Exception:  # offline, gated, no such repo: the text path reports it
            return False
    else:
        return False
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def load_vision(path: str) -> tuple[Any, Any, dict[str, Any]]:
    """mlx-vlm's model and processor of a local folder or hub id, and its config."""
    try:
        from mlx_vlm import load
        from mlx_vlm.utils import load_config
    except ImportError as exc:
        raise ValueError(
            "this is a vision-language model: install batchmlx's vision extra "
            "(pip install 'batchmlx[vision]') to serve it"
        ) from exc
    model, processor = load(path)
    return model, processor, load_config(path)
