"""Vision-language prompts (mlx-vlm's processor): chat messages and their images and videos
turned into what the vision runner (engine/runners/vision.py) runs.

`VisionPrompter` renders the model's chat template (an entry per part), runs the processor for
the pixels and its expanded placeholder tokens, and makes one `MediaSpan` per part (its
placeholder run keyed by the part's digest, for the prefix cache: core/media.py). A video's
frames come from engine/vision/video.py.
"""

from __future__ import annotations

import io
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from batchmlx.core.media import MediaSpan
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.media import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_FRAMES, MediaKind, MediaPart


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


class VisionPrompter:
    """Messages and resolved media parts → (prompt tokens, spans, inputs), through the model's
    own processor (mlx-vlm loads it with the model). Videos are decoded into frames here
    (engine/vision/video.py) and go to the processor as `videos=`, on the families that take
    them."""

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

    from batchmlx.engine.vision.video import VideoUnreadable, decode_video

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
